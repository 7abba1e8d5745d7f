//! The RabbitMQ connection (lapin).
//!
//! lapin does not reconnect by itself, so services own a loop: [`connect`]
//! (retrying with capped exponential backoff until it succeeds or shutdown),
//! declare their topology, work until the connection or a channel fails, then
//! go round again. [`Connected`] tracks the state for `/readyz`.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};
use std::time::Duration;

use lapin::{
    options::ExchangeDeclareOptions,
    types::{AMQPValue, FieldTable},
    Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio_util::sync::CancellationToken;

use crate::settings::{redact_url, AmqpSettings};

pub use lapin;

#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("shut down while connecting to the broker")]
    Cancelled,
    #[error(transparent)]
    Lapin(#[from] lapin::Error),
}

/// How long a broker's answer to a channel's open or close is awaited on the
/// way out ([`close_bounded`]).
pub const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// Close `channel` if it is still open, waiting at most [`CLOSE_WAIT`] for
/// the broker's answer: a broker in trouble (the reason a channel is
/// replaced, say) must not hold a worker, nor a shutdown. Closed before its
/// connection: a channel dropped open closes itself in the background, and
/// when the connection's close overtakes that, lapin puts the connection in
/// error and logs "Connection error" at ERROR.
pub async fn close_bounded(channel: &Channel, reason: &str) {
    if !channel.status().connected() {
        return;
    }
    let closing = channel.close(200, reason.into());
    if tokio::time::timeout(CLOSE_WAIT, closing).await.is_err() {
        tracing::warn!(
            reason,
            waited_secs = CLOSE_WAIT.as_secs(),
            "the broker did not confirm the channel close in time"
        );
    }
}

/// How long a frame (a publish, an acknowledgement, a return) may wait to be
/// written. lapin writes nothing on a connection the broker blocks (a
/// memory or disk alarm: the broker blocks a connection once it publishes),
/// and its publish, ack and nack resolve only once their frames are
/// written: unbounded, they waited for the end of the alarm, deaf to
/// shutdown. A frame past it stays queued in lapin and goes out when the
/// alarm ends (a publish retried meanwhile is then one more copy).
pub const WRITE_WAIT: Duration = Duration::from_secs(5);

/// How long closing a connection may wait for the broker's answer.
pub const CONNECTION_CLOSE_WAIT: Duration = Duration::from_secs(3);

/// Open a channel on `connection`, unless `shutdown` comes first: `None`
/// then. A stop during the open still waits for it (at most [`CLOSE_WAIT`])
/// and closes what opened, for the reason [`close_bounded`] gives: a
/// channel dropped open, or an open answered after the connection began to
/// close, puts the connection in error, and lapin logs an ERROR.
pub async fn open_channel(
    connection: &Connection,
    shutdown: &CancellationToken,
) -> Result<Option<Channel>, lapin::Error> {
    let creating = connection.create_channel();
    tokio::pin!(creating);
    tokio::select! {
        () = shutdown.cancelled() => {
            if let Ok(Ok(channel)) = tokio::time::timeout(CLOSE_WAIT, &mut creating).await {
                close_bounded(&channel, "shutting down").await;
            }
            Ok(None)
        }
        channel = &mut creating => channel.map(Some),
    }
}

/// Close `connection` if it is up, waiting at most [`CONNECTION_CLOSE_WAIT`]:
/// a broker that does not answer (stalled, or blocking the connection under
/// an alarm: lapin then writes nothing, the close included) must not hold
/// up a shutdown or the end of a command. Unacknowledged messages are
/// returned when the socket goes anyway.
pub async fn close_connection_bounded(connection: &Connection, reason: &str) {
    if !connection.status().connected() {
        return;
    }
    let closing = connection.close(200, reason.into());
    match tokio::time::timeout(CONNECTION_CLOSE_WAIT, closing).await {
        Ok(Ok(())) => tracing::debug!(reason, "broker connection closed"),
        Ok(Err(error)) => tracing::debug!(reason, %error, "closing the broker connection"),
        Err(_) => tracing::warn!(
            reason,
            waited_secs = CONNECTION_CLOSE_WAIT.as_secs(),
            "the broker did not confirm the connection close in time"
        ),
    }
}

/// Whether a service currently holds a working broker connection (for
/// `/readyz`): up, and not blocked by the broker (a memory or disk alarm
/// blocks every connection that publishes until it clears: the relay then
/// publishes nothing). A consumer watches its consuming connection, which
/// never publishes (its copies go out on a second one), so it is not
/// blocked: an alarm holds only the messages that need a copy.
#[derive(Clone, Debug, Default)]
pub struct Connected(Arc<ConnectedState>);

#[derive(Debug, Default)]
struct ConnectedState {
    up: AtomicBool,
    /// The current connection's status, kept up to date by lapin
    /// (`connection.blocked` / `connection.unblocked` from the broker).
    status: std::sync::Mutex<Option<lapin::ConnectionStatus>>,
}

impl Connected {
    pub fn set(&self, connected: bool) {
        self.0.up.store(connected, Ordering::Relaxed);
    }
    /// Follow `connection`'s blocked state from now on.
    pub fn watch(&self, connection: &Connection) {
        if let Ok(mut status) = self.0.status.lock() {
            *status = Some(connection.status().clone());
        }
    }
    /// For `/readyz`: `ok`, `blocked` (up, but the broker blocks it) or
    /// `disconnected`.
    pub fn state(&self) -> &'static str {
        if !self.0.up.load(Ordering::Relaxed) {
            "disconnected"
        } else if self.blocked() {
            "blocked"
        } else {
            "ok"
        }
    }
    /// Whether the broker blocks the watched connection.
    fn blocked(&self) -> bool {
        self.0
            .status
            .lock()
            .ok()
            .and_then(|status| status.as_ref().map(lapin::ConnectionStatus::blocked))
            .unwrap_or(false)
    }
}

/// [`connect`]'s TCP connect bound unless the URL names one.
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;

/// `url` with a `connection_timeout` (ms) unless it has one; `None` when it
/// does not parse (the caller connects with the text and gets lapin's error).
fn with_connect_timeout(url: &str) -> Option<lapin::uri::AMQPUri> {
    let mut uri: lapin::uri::AMQPUri = url.parse().ok()?;
    uri.query
        .connection_timeout
        .get_or_insert(CONNECT_TIMEOUT_MS);
    Some(uri)
}

/// One connection attempt whose TCP connect to each of the host's
/// addresses ends at the URL's `connection_timeout` (else
/// [`CONNECT_TIMEOUT_MS`]), and then its AMQP handshake at the same bound.
/// lapin reads that setting only on its blocking connect path, never on the
/// async one it uses, and bounds no handshake, so the bounds are ours: the
/// connect lapin's I/O thread runs is given a timeout (it runs in the Tokio
/// runtime's context, `block_on` on its handle); a handshake the peer never
/// answers (a frozen broker, a proxy before a dead one) ends with the
/// socket shut down, which ends lapin's I/O loop too, and so does an
/// attempt dropped during its handshake (a shutdown): nothing outlives the
/// attempt (a timeout that only dropped the attempt would leave lapin's
/// thread and socket behind, one per retry). lapin may log the end of that
/// socket at ERROR.
async fn connect_once(url: &str, properties: ConnectionProperties) -> lapin::Result<Connection> {
    let Some(uri) = with_connect_timeout(url) else {
        return Connection::connect(url, properties).await;
    };
    let bound = Duration::from_millis(uri.query.connection_timeout.unwrap_or(CONNECT_TIMEOUT_MS));
    let runtime = lapin::runtime::default_runtime()?;
    // The connected socket (a duplicate of its descriptor), handed over
    // once the TCP connect is done: the handshake's bound starts then.
    let (connected, tcp_up) = tokio::sync::oneshot::channel::<Option<socket2::Socket>>();
    let connected = std::sync::Mutex::new(Some(connected));
    // lapin calls the closure once per attempt (its default backoff retries
    // nothing); should it call it again after the attempt was abandoned
    // (a reconnect of the I/O loop it ended), it connects nowhere.
    let abandoned = Arc::new(AtomicBool::new(false));
    let mut guard = Abandon {
        socket: None,
        abandoned: abandoned.clone(),
    };
    let connecting = Connection::connector(
        uri,
        runtime,
        async move |uri, runtime| {
            use lapin::tcp::AMQPUriTcpExt as _;
            if abandoned.load(Ordering::Relaxed) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "the connection attempt was abandoned",
                )
                .into());
            }
            // Each address of the name on its own bound (as lapin's blocking
            // path does): a name with several addresses whose first drops
            // packets still reaches the others.
            let (host, port) = (uri.authority.host.clone(), uri.authority.port);
            let mut last = std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{host} has no address"),
            );
            for address in tokio::net::lookup_host((host.as_str(), port)).await? {
                let mut one = uri.clone();
                one.authority.host = address.ip().to_string();
                one.authority.port = address.port();
                let connect =
                    one.connect_with_config_async(lapin::tcp::TLSConfig::default(), &runtime);
                match tokio::time::timeout(bound, connect).await {
                    Ok(Ok(stream)) => {
                        let socket = match &stream {
                            lapin::tcp::AsyncTcpStream::Plain(plain) => {
                                match socket2::SockRef::from(plain.get_ref()).try_clone() {
                                    Ok(socket) => Some(socket),
                                    Err(error) => {
                                        tracing::warn!(%error, "cannot duplicate the AMQP socket: its handshake is not bounded");
                                        None
                                    }
                                }
                            }
                            _ => None,
                        };
                        if let Some(connected) = connected.lock().ok().and_then(|mut c| c.take()) {
                            let _ = connected.send(socket);
                        }
                        return Ok(stream);
                    }
                    Ok(Err(error)) => last = error,
                    Err(_) => {
                        last = std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "TCP connect to {address} not done within {} ms",
                                bound.as_millis()
                            ),
                        )
                    }
                }
            }
            Err(last.into())
        },
        properties,
    );
    tokio::pin!(connecting);
    guard.socket = tokio::select! {
        // Done (or failed) without a TCP connection handed over.
        attempt = &mut connecting => return attempt,
        socket = tcp_up => socket.ok().flatten(),
    };
    match tokio::time::timeout(bound, connecting).await {
        Ok(attempt) => {
            // Done: the socket is lapin's (the duplicate is only closed).
            guard.socket = None;
            attempt
        }
        // `guard` shuts the socket down.
        Err(_) => Err(lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the AMQP handshake was not answered within {} ms",
                bound.as_millis()
            ),
        ))),
    }
}

/// An attempt's socket (a duplicated descriptor) while its handshake runs:
/// shut down when the attempt is abandoned (its bound passed, or the
/// attempt dropped), which ends lapin's I/O loop on it.
struct Abandon {
    socket: Option<socket2::Socket>,
    abandoned: Arc<AtomicBool>,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if let Some(socket) = self.socket.take() {
            self.abandoned.store(true, Ordering::Relaxed);
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Connect, retrying with capped exponential backoff (100 ms .. 5 s) until the
/// broker accepts or `shutdown` is cancelled; an attempt in progress ends at
/// once on shutdown. The TCP connect of an attempt is bounded (the URL's
/// `connection_timeout`, else [`CONNECT_TIMEOUT_MS`]: [`connect_once`]): a
/// broker address that drops packets would hold it for the kernel's SYN
/// retries (~2 min); so is its AMQP handshake (a peer that never answers it
/// held the attempt forever, never retried).
pub async fn connect(
    settings: &AmqpSettings,
    connection_name: &str,
    shutdown: &CancellationToken,
) -> Result<Connection, AmqpError> {
    let mut delay = Duration::from_millis(100);
    loop {
        let properties =
            ConnectionProperties::default().with_connection_name(connection_name.into());
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return Err(AmqpError::Cancelled),
            attempt = connect_once(&settings.url, properties) => attempt,
        };
        match attempt {
            Ok(connection) => {
                tracing::info!(url = %redact_url(&settings.url), connection = connection_name, "connected to RabbitMQ");
                return Ok(connection);
            }
            Err(error) => tracing::warn!(
                url = %redact_url(&settings.url),
                connection = connection_name,
                %error,
                retry_in_ms = delay.as_millis() as u64,
                "RabbitMQ not reachable"
            ),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Err(AmqpError::Cancelled),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// AMQP reply code 406: a declaration with other arguments than the
/// existing queue's or exchange's (or another precondition refused).
pub const PRECONDITION_FAILED: u16 = 406;

/// The AMQP reply code of a channel or connection closed by the broker.
pub fn reply_code(error: &lapin::Error) -> Option<u16> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// Declare the topic exchange every order event is published to (idempotent;
/// the relay and every consumer declare it with the same arguments).
pub async fn declare_order_events_exchange(channel: &Channel) -> Result<(), lapin::Error> {
    declare_topic_exchange(channel, events::EXCHANGE).await
}

/// `queue` as the broker holds it (its message count), declaring nothing: a
/// missing queue is an error (404), which closes `channel`.
pub async fn passive_declare(channel: &Channel, queue: &str) -> Result<lapin::Queue, lapin::Error> {
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..lapin::options::QueueDeclareOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
}

/// Declare a durable topic exchange named `name` the way `order-events` is
/// declared (idempotent): a relay configured to publish elsewhere
/// (`OUTBOX_RELAY__RELAY__EXCHANGE`, the tests' private exchanges) uses it.
pub async fn declare_topic_exchange(channel: &Channel, name: &str) -> Result<(), lapin::Error> {
    channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
}

/// Why a confirmed publish did not make it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishRejected {
    /// `mandatory` and no queue bound: lapin reports an Ack carrying the
    /// returned message (reply 312 NO_ROUTE). That is a failure, not a publish.
    #[error("unroutable: returned by the broker ({code} {text})")]
    Returned { code: u16, text: String },
    #[error("negatively acknowledged by the broker")]
    Nacked,
    #[error("publisher confirms are not enabled on this channel")]
    NotConfirmed,
}

/// Interpret a publisher confirmation: only a plain Ack is a success.
pub fn check_confirmation(confirmation: Confirmation) -> Result<(), PublishRejected> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
            Err(PublishRejected::Returned {
                code: returned.reply_code,
                text: returned.reply_text.to_string(),
            })
        }
        Confirmation::Nack(None) => Err(PublishRejected::Nacked),
        Confirmation::NotRequested => Err(PublishRejected::NotConfirmed),
    }
}

/// Run `work` on a fresh connection, and again on a new one whenever it fails,
/// until `shutdown` is cancelled. `work` returns `Ok(())` only on shutdown;
/// any `Err` (connection or channel lost, declaration refused) means
/// "reconnect". `connected` is up while `work` holds a connection.
pub async fn supervise<F, Fut>(
    settings: &AmqpSettings,
    connection_name: &str,
    connected: &Connected,
    shutdown: &CancellationToken,
    mut work: F,
) where
    F: FnMut(Connection) -> Fut,
    Fut: std::future::Future<Output = Result<(), lapin::Error>>,
{
    let mut delay = FIRST_RECONNECT_PAUSE;
    while !shutdown.is_cancelled() {
        let connection = match connect(settings, connection_name, shutdown).await {
            Ok(connection) => connection,
            Err(_) => return, // cancelled
        };
        connected.watch(&connection);
        connected.set(true);
        let started = std::time::Instant::now();
        let result = work(connection).await;
        connected.set(false);
        delay = reconnect_pause(delay, started.elapsed());
        match result {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "broker connection lost; reconnecting");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(MAX_RECONNECT_PAUSE);
    }
}

const FIRST_RECONNECT_PAUSE: Duration = Duration::from_millis(200);
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(5);
/// A connection that worked this long ends a run of failures.
const CONNECTION_HELD_LONG: Duration = Duration::from_secs(30);

/// The pause before reconnecting, `pause` being the one due after the last
/// failure, for a connection that held `held`: doubling (up to
/// [`MAX_RECONNECT_PAUSE`]) while connections fail soon after opening (a
/// declaration refused: no tight loop), the first again after one that
/// worked for a while (an outage weeks after the last is not met with the
/// longest pause).
fn reconnect_pause(pause: Duration, held: Duration) -> Duration {
    if held >= CONNECTION_HELD_LONG {
        FIRST_RECONNECT_PAUSE
    } else {
        pause
    }
}

/// Resolve when `connection` is no longer usable (closed by the broker, a
/// network error, a missed heartbeat). lapin exposes the state, not an event we
/// can await portably, so this polls it.
pub async fn closed(connection: &Connection) -> lapin::Error {
    loop {
        let status = connection.status();
        let state = if status.closed() || status.closing() {
            Some(lapin::ConnectionState::Closed)
        } else if status.errored() {
            Some(lapin::ConnectionState::Error)
        } else {
            None
        };
        if let Some(state) = state {
            return lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(state));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// An integer header (any AMQP integer type, or a decimal string).
pub fn int_header(headers: Option<&FieldTable>, name: &str) -> Option<i64> {
    let value = headers?.inner().get(name)?;
    match value {
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        _ => None,
    }
}

/// A string header (long or short string).
pub fn str_header(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    let value = headers?.inner().get(name)?;
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reconnect_pause_grows_while_connections_fail_fast_and_restarts_after_one_that_held() {
        let mut pause = FIRST_RECONNECT_PAUSE;
        let mut pauses = Vec::new();
        for _ in 0..7 {
            pause = reconnect_pause(pause, Duration::from_secs(1));
            pauses.push(pause.as_millis());
            pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
        }
        assert_eq!(pauses, [200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(
            reconnect_pause(pause, CONNECTION_HELD_LONG),
            FIRST_RECONNECT_PAUSE,
            "a connection that worked for a while"
        );
    }

    #[test]
    fn a_connect_is_bounded_unless_the_url_says_otherwise() {
        let bounded = with_connect_timeout("amqp://app:app@127.0.0.1:5672/%2f").expect("url");
        assert_eq!(bounded.query.connection_timeout, Some(CONNECT_TIMEOUT_MS));
        let own = with_connect_timeout("amqp://h/%2f?connection_timeout=2500").expect("url");
        assert_eq!(own.query.connection_timeout, Some(2500));
    }

    /// An address that drops SYNs (here a listener whose accept queue is
    /// full: Linux drops the SYNs it cannot queue) ends an attempt at the
    /// URL's `connection_timeout`, not after the kernel's SYN retries
    /// (~2 min; lapin ignores the setting on its async connect).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_to_an_address_that_drops_syns_ends_at_the_timeout() {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.1:0".parse().expect("address"))
            .expect("bind");
        let listener = socket.listen(1).expect("listen");
        let address = listener.local_addr().expect("address");
        // Fill the accept queue (never accepted): later SYNs are dropped.
        let mut held = Vec::new();
        for _ in 0..4 {
            if let Ok(Ok(stream)) = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(address),
            )
            .await
            {
                held.push(stream);
            }
        }
        assert!(!held.is_empty(), "the accept queue took no connection");
        let hangs = tokio::time::timeout(
            Duration::from_secs(3),
            tokio::net::TcpStream::connect(address),
        )
        .await;
        assert!(
            hangs.is_err(),
            "a connect to the full queue did not hang: the test proves nothing"
        );

        let url = format!("amqp://app:app@{address}/%2f?connection_timeout=1000");
        let started = std::time::Instant::now();
        let attempt = tokio::time::timeout(
            Duration::from_secs(60),
            connect_once(&url, ConnectionProperties::default()),
        )
        .await
        .expect("the attempt ends within 60 s");
        assert!(attempt.is_err(), "nothing speaks AMQP there");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the attempt took {:?}: its TCP connect is not bounded",
            started.elapsed()
        );
        drop(listener);
    }

    /// A peer that takes the TCP connection and never answers the AMQP
    /// handshake (a frozen broker, a proxy in front of a dead one) ends an
    /// attempt at the URL's `connection_timeout`, with its socket closed
    /// (lapin's I/O loop ends with it): the peer reads the end of the
    /// stream. lapin bounds no handshake: the attempt waited forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handshake_never_answered_ends_at_the_timeout_and_closes_the_socket() {
        use tokio::io::AsyncReadExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let url = format!("amqp://app:app@{address}/%2f?connection_timeout=1000");
        let started = std::time::Instant::now();
        let attempt =
            tokio::spawn(async move { connect_once(&url, ConnectionProperties::default()).await });
        let (mut peer, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("the attempt connects within 10 s")
            .expect("accept");
        // The client's protocol header arrives; nothing is answered.
        let mut header = [0_u8; 8];
        peer.read_exact(&mut header).await.expect("protocol header");
        assert_eq!(&header[..4], b"AMQP");
        let attempt = tokio::time::timeout(Duration::from_secs(60), attempt)
            .await
            .expect("the attempt ends within 60 s")
            .expect("join");
        assert!(attempt.is_err(), "nothing answered the handshake");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the attempt took {:?}: its handshake is not bounded",
            started.elapsed()
        );
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(10), peer.read_to_end(&mut rest)).await;
        assert!(
            matches!(closed, Ok(Ok(_))),
            "the attempt's socket was left open: {closed:?}"
        );
        // Nothing connects again for the abandoned attempt.
        assert!(
            tokio::time::timeout(Duration::from_secs(2), listener.accept())
                .await
                .is_err(),
            "the abandoned attempt connected again"
        );
    }
}
