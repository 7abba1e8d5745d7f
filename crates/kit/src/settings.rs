//! Configuration through the `config` crate.
//!
//! Every service has a settings struct whose `Default` is the zero-configuration
//! local setup (`make up`'s PostgreSQL and RabbitMQ). Layers, later wins:
//!
//! 1. the struct's defaults;
//! 2. an optional TOML file named by `<PREFIX>__CONFIG_FILE`
//!    (e.g. `ORDER_API__CONFIG_FILE=/etc/order-api.toml`);
//! 3. environment variables `<PREFIX>__<SECTION>__<FIELD>`, e.g.
//!    `ORDER_API__DATABASE__URL` or `INVENTORY_CONSUMER__HTTP__PORT`.

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Load settings for the service whose environment prefix is `prefix`
/// (e.g. `"ORDER_API"`), starting from `defaults`.
pub fn load<T>(prefix: &str, defaults: &T) -> Result<T, config::ConfigError>
where
    T: Serialize + DeserializeOwned,
{
    let mut builder = config::Config::builder().add_source(config::Config::try_from(defaults)?);
    if let Ok(file) = std::env::var(format!("{prefix}__CONFIG_FILE")) {
        builder = builder.add_source(config::File::with_name(&file).required(true));
    }
    builder
        .add_source(
            config::Environment::with_prefix(prefix)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true),
        )
        .build()?
        .try_deserialize()
}

/// A PostgreSQL database.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatabaseSettings {
    /// `postgres://user:password@host:port/database`
    pub url: String,
    /// Maximum connections in the pool (order-api splits them between its
    /// HTTP workers, one pool each, and keeps two more for migrations,
    /// health and its key cleanup).
    pub pool_size: usize,
    /// Bound on waiting for a pooled connection, in milliseconds.
    pub acquire_timeout_ms: u64,
}

impl DatabaseSettings {
    /// The local default for database `name` (what `make up` creates).
    pub fn local(name: &str) -> Self {
        Self {
            url: format!("postgres://app:app@127.0.0.1:5432/{name}"),
            pool_size: 16,
            acquire_timeout_ms: 5_000,
        }
    }
}

/// The RabbitMQ broker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AmqpSettings {
    /// `amqp://user:password@host:port/vhost` (vhost `/` is `%2f`).
    pub url: String,
}

impl Default for AmqpSettings {
    fn default() -> Self {
        Self {
            url: "amqp://app:app@127.0.0.1:5672/%2f".to_owned(),
        }
    }
}

/// Where a service listens for HTTP (API, health, metrics).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpSettings {
    pub host: String,
    pub port: u16,
    /// HTTP worker threads of a service that serves an API (order-api); 0 =
    /// one per available core. Health/metrics-only servers
    /// always use one.
    #[serde(default)]
    pub workers: usize,
}

impl HttpSettings {
    pub fn local(port: u16) -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port,
            workers: 0,
        }
    }

    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// Hide the password of a connection URL for logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{}:***{}", &url[..scheme_end + 3], user, &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct Demo {
        database: DatabaseSettings,
        http: HttpSettings,
        name: String,
    }

    #[test]
    fn environment_overrides_defaults_by_prefix_and_double_underscore() {
        let defaults = Demo {
            database: DatabaseSettings::local("orders"),
            http: HttpSettings::local(8080),
            name: "x".into(),
        };
        // A prefix no other test uses, so parallel tests cannot interfere.
        std::env::set_var("KIT_SETTINGS_TEST__HTTP__PORT", "9999");
        std::env::set_var(
            "KIT_SETTINGS_TEST__DATABASE__URL",
            "postgres://u:p@db.example:6543/other",
        );
        let loaded: Demo = load("KIT_SETTINGS_TEST", &defaults).expect("load");
        assert_eq!(loaded.http.port, 9999);
        assert_eq!(loaded.http.host, "127.0.0.1");
        assert_eq!(loaded.database.url, "postgres://u:p@db.example:6543/other");
        assert_eq!(loaded.database.pool_size, 16);
        assert_eq!(loaded.name, "x");
    }

    #[test]
    fn zero_configuration_is_the_defaults() {
        let defaults = Demo {
            database: DatabaseSettings::local("ledger"),
            http: HttpSettings::local(8082),
            name: "y".into(),
        };
        let loaded: Demo = load("KIT_SETTINGS_UNSET_PREFIX", &defaults).expect("load");
        assert_eq!(loaded, defaults);
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://app:secret@127.0.0.1:5432/orders"),
            "postgres://app:***@127.0.0.1:5432/orders"
        );
        assert_eq!(redact_url("amqp://localhost"), "amqp://localhost");
    }
}
