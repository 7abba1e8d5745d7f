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
//!
//! A `<PREFIX>__...` variable or a key of the file that names no setting (a
//! typo) stops the service at start-up with the list of its settings, and
//! so does a word of yes or no given to a number setting in either.

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Load settings for the service whose environment prefix is `prefix`
/// (e.g. `"ORDER_API"`), starting from `defaults`.
pub fn load<T>(prefix: &str, defaults: &T) -> Result<T, config::ConfigError>
where
    T: Serialize + DeserializeOwned,
{
    // Names only, and never a panic on a name or value that is not UTF-8
    // (`std::env::vars` would; config skips such names too).
    let names = std::env::vars_os().filter_map(|(name, _)| name.into_string().ok());
    reject_unknown_variables(prefix, defaults, names)?;
    let mut builder = config::Config::builder().add_source(config::Config::try_from(defaults)?);
    let file = config_file(prefix, std::env::vars_os())?;
    if let Some(file) = &file {
        builder = builder.add_source(config::File::with_name(file).required(true));
    }
    // No `try_parsing`: it would store a value that looks like a number or a
    // bool as one, and a text field would read back its spelling as a number
    // (`ONLY_TENANT=007` became "7"). Number and bool fields still parse
    // from the text.
    let loaded: T = builder
        .add_source(
            config::Environment::with_prefix(prefix)
                .prefix_separator("__")
                .separator("__"),
        )
        .build()?
        .try_deserialize()?;
    // Against the settings as loaded: a number setting without a default
    // (`Option<u64>`, null in `defaults`) is a number there.
    if let Some(file) = &file {
        reject_unknown_file_settings(file, defaults, &loaded)?;
    }
    let vars = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)));
    reject_words_for_numbers(prefix, &loaded, vars)?;
    Ok(loaded)
}

/// The file `<prefix>__CONFIG_FILE` names, the variable's name in any case
/// as config matches the other variables (a lower-case spelling passed the
/// typo check and was ignored); an error when two spellings are set.
fn config_file(
    prefix: &str,
    vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Option<String>, config::ConfigError> {
    let wanted = format!("{prefix}__CONFIG_FILE");
    let mut found: Vec<(String, String)> = Vec::new();
    for (name, value) in vars {
        let Ok(name) = name.into_string() else {
            continue;
        };
        if name.to_uppercase() == wanted {
            let value = value
                .into_string()
                .map_err(|_| config::ConfigError::Message(format!("{name} is not UTF-8")))?;
            found.push((name, value));
        }
    }
    match found.as_slice() {
        [] => Ok(None),
        [(_, file)] => Ok(Some(file.clone())),
        several => Err(config::ConfigError::Message(format!(
            "the configuration file is named more than once: {}",
            several
                .iter()
                .map(|(name, _)| name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Fail on a `<prefix>__...` variable that names no setting (a typo such as
/// `ORDER_API__DATABASE_URL` or `..._BATCHSIZE`): ignored, the service would
/// run on a default without a word. The settings are the leaves of
/// `defaults` (every field is serialized, an absent optional one as null);
/// `<prefix>__CONFIG_FILE` names the file layer.
fn reject_unknown_variables<T: Serialize>(
    prefix: &str,
    defaults: &T,
    names: impl Iterator<Item = String>,
) -> Result<(), config::ConfigError> {
    let mut known = vec!["CONFIG_FILE".to_owned()];
    known.extend(settings_of(defaults)?.into_iter().map(|(name, _)| name));
    let start = format!("{prefix}__");
    // config matches the prefix in any case (it lowercases the names).
    let unknown: Vec<String> = names
        .filter_map(|name| {
            let key = name.to_uppercase().strip_prefix(&start)?.to_owned();
            (!known.contains(&key)).then_some(name)
        })
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    known.sort();
    Err(config::ConfigError::Message(format!(
        "unknown setting(s) {}: the settings are {}",
        unknown.join(", "),
        known
            .iter()
            .map(|k| format!("{start}{k}"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// The settings: the leaves of `defaults` (every field is serialized, an
/// absent optional one as null), each by its variable's name after the
/// prefix (`DATABASE__URL`), with its default.
fn settings_of<T: Serialize>(
    defaults: &T,
) -> Result<Vec<(String, serde_json::Value)>, config::ConfigError> {
    let tree =
        serde_json::to_value(defaults).map_err(|e| config::ConfigError::Message(e.to_string()))?;
    let mut settings = Vec::new();
    leaves(tree, String::new(), &mut settings);
    Ok(settings)
}

/// The leaves of `value` by their paths in capitals (`DATABASE__URL`, as
/// the variables name them).
fn leaves(value: serde_json::Value, path: String, into: &mut Vec<(String, serde_json::Value)>) {
    let mut found = Vec::new();
    leaves_as_written(value, path, &mut found);
    into.extend(
        found
            .into_iter()
            .map(|(path, value)| (path.to_uppercase(), value)),
    );
}

/// The leaves of `value` by their paths as written (`database__url`).
fn leaves_as_written(
    value: serde_json::Value,
    path: String,
    into: &mut Vec<(String, serde_json::Value)>,
) {
    match value {
        serde_json::Value::Object(fields) => {
            for (name, value) in fields {
                let path = if path.is_empty() {
                    name
                } else {
                    format!("{path}__{name}")
                };
                leaves_as_written(value, path, into);
            }
        }
        value => into.push((path, value)),
    }
}

/// A word config reads as a bool, and as 1 or 0 for a number.
fn is_word_for_a_number(value: &str) -> bool {
    matches!(
        value.trim().to_lowercase().as_str(),
        "true" | "false" | "yes" | "no" | "on" | "off"
    )
}

/// Fail on a key of the configuration file that names no setting
/// (`[database] pool_szie = 4`), and on a word of yes or no given to a
/// number setting there (`pool_size = "yes"`), as for the variables: config
/// ignored the one (the service ran on the default) and read the other as
/// one. A setting whose default is absent (null) may be given as a table.
/// The number settings are those that hold a number in `loaded` (the
/// settings as loaded: one without a default holds the word's number then).
fn reject_unknown_file_settings<T: Serialize>(
    file: &str,
    defaults: &T,
    loaded: &T,
) -> Result<(), config::ConfigError> {
    let tree: serde_json::Value = config::Config::builder()
        .add_source(config::File::with_name(file).required(true))
        .build()?
        .try_deserialize()?;
    // The file's keys as written (config keeps their case, and the settings
    // match only their own, lower-case, names: `[DATABASE]` was ignored),
    // against the settings' names.
    let known: Vec<(String, serde_json::Value)> = settings_of(defaults)?
        .into_iter()
        .map(|(name, default)| (name.to_lowercase(), default))
        .collect();
    let numbers: Vec<String> = settings_of(loaded)?
        .into_iter()
        .filter(|(_, value)| value.is_number())
        .map(|(name, _)| name.to_lowercase())
        .collect();
    let mut given = Vec::new();
    leaves_as_written(tree, String::new(), &mut given);
    let key = |path: &str| path.replace("__", ".");
    let mut refused = Vec::new();
    for (path, value) in given {
        let setting = known.iter().find(|(name, default)| {
            *name == path || (default.is_null() && path.starts_with(&format!("{name}__")))
        });
        match setting {
            None => refused.push(format!("{} names no setting", key(&path))),
            Some((name, _))
                if numbers.contains(name)
                    && (value.is_boolean() || value.as_str().is_some_and(is_word_for_a_number)) =>
            {
                refused.push(format!("{} = {value}: a number is expected", key(&path)));
            }
            Some(_) => {}
        }
    }
    if refused.is_empty() {
        return Ok(());
    }
    let mut settings: Vec<String> = known.iter().map(|(name, _)| key(name)).collect();
    settings.sort();
    Err(config::ConfigError::Message(format!(
        "configuration file {file}: {}; the settings are {}",
        refused.join(", "),
        settings.join(", ")
    )))
}

/// Fail on a word of yes or no given to a number setting
/// (`..._POOL_SIZE=yes`): `config` reads `true`, `yes` and `on` as 1,
/// `false`, `no` and `off` as 0, so a mistake ran on 1 or 0 (a pool of one
/// connection, a batch of none) without a word. The number settings are
/// those that hold a number in `settings` (as loaded: one without a
/// default holds the word's number then).
fn reject_words_for_numbers<T: Serialize>(
    prefix: &str,
    settings: &T,
    vars: impl Iterator<Item = (String, String)>,
) -> Result<(), config::ConfigError> {
    let numbers: Vec<String> = settings_of(settings)?
        .into_iter()
        .filter(|(_, default)| default.is_number())
        .map(|(name, _)| name)
        .collect();
    let start = format!("{prefix}__");
    let refused: Vec<String> = vars
        .filter(|(name, value)| {
            name.to_uppercase()
                .strip_prefix(&start)
                .is_some_and(|key| numbers.iter().any(|n| n == key))
                && is_word_for_a_number(value)
        })
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    Err(config::ConfigError::Message(format!(
        "{}: a number is expected",
        refused.join(", ")
    )))
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

impl AmqpSettings {
    /// A URL that can never connect (a bad port, an unknown scheme) is a
    /// configuration error to stop on, not a broker to wait for.
    pub fn validate(&self) -> Result<(), String> {
        let uri = self
            .url
            .parse::<lapin::uri::AMQPUri>()
            .map_err(|error| format!("amqp.url {}: {error}", redact_url(&self.url)))?;
        // This build has no TLS backend (lapin without one connects
        // `amqps://` in clear text, or to a TLS port it cannot talk to,
        // forever): refuse rather than send credentials unencrypted.
        if uri.scheme == lapin::uri::AMQPScheme::AMQPS {
            return Err(format!(
                "amqp.url {}: amqps:// needs TLS, which this build does not have \
                 (use amqp:// on a trusted network, or terminate TLS in front of the broker)",
                redact_url(&self.url)
            ));
        }
        Ok(())
    }
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

/// Hide the password of a connection URL or key=value string for logs:
/// `user:password@` in a URL, and any `password=` value (a URL's query
/// parameter, or the `host=... password=...` form).
pub fn redact_url(url: &str) -> String {
    let url = match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{}:***{}", &url[..scheme_end + 3], user, &url[at..])
        }
        _ => url.to_owned(),
    };
    let mut redacted = String::with_capacity(url.len());
    let mut rest = url.as_str();
    while let Some(at) = rest.to_ascii_lowercase().find("password") {
        let key_end = at + "password".len();
        // The key=value form allows spaces around the `=`.
        let equals = key_end + leading_spaces(&rest[key_end..]);
        if !rest[equals..].starts_with('=') {
            // The word alone (in a host name, say): not a password.
            redacted.push_str(&rest[..key_end]);
            rest = &rest[key_end..];
            continue;
        }
        let value = equals + 1 + leading_spaces(&rest[equals + 1..]);
        redacted.push_str(&rest[..value]);
        redacted.push_str("***");
        let end = if rest[value..].starts_with('\'') {
            // A quoted key=value password may hold spaces: up to its
            // closing quote (a backslash escapes a quote inside).
            let bytes = rest.as_bytes();
            let mut i = value + 1;
            while i < bytes.len() && bytes[i] != b'\'' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            (i + 1).min(rest.len())
        } else {
            rest[value..]
                .find(|c: char| c == '&' || c.is_whitespace())
                .map_or(rest.len(), |n| value + n)
        };
        rest = &rest[end..];
    }
    redacted.push_str(rest);
    redacted
}

/// The length in bytes of `text`'s leading whitespace.
fn leading_spaces(text: &str) -> usize {
    text.len() - text.trim_start().len()
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
    fn an_amqp_url_that_cannot_connect_is_refused() {
        assert_eq!(AmqpSettings::default().validate(), Ok(()));
        for url in [
            "amqp://app:app@127.0.0.1:notaport/%2f",
            "http://127.0.0.1:5672",
            "amqps://app:app@127.0.0.1/%2f",
        ] {
            let settings = AmqpSettings {
                url: url.to_owned(),
            };
            assert!(settings.validate().is_err(), "{url}");
        }
    }

    #[test]
    fn the_config_file_is_found_in_any_case_and_once() {
        let vars = |names: &[(&str, &str)]| {
            names
                .iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect::<Vec<(std::ffi::OsString, std::ffi::OsString)>>()
                .into_iter()
        };
        assert_eq!(
            config_file("ORDER_API", vars(&[("ORDER_API__CONFIG_FILE", "/a.toml")])).expect("one"),
            Some("/a.toml".to_owned())
        );
        assert_eq!(
            config_file("ORDER_API", vars(&[("order_api__config_file", "/b.toml")])).expect("one"),
            Some("/b.toml".to_owned())
        );
        assert_eq!(
            config_file("ORDER_API", vars(&[("OTHER__CONFIG_FILE", "/c.toml")])).expect("none"),
            None
        );
        assert!(config_file(
            "ORDER_API",
            vars(&[
                ("ORDER_API__CONFIG_FILE", "/a.toml"),
                ("order_api__config_file", "/b.toml")
            ])
        )
        .is_err());
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://app:secret@127.0.0.1:5432/orders"),
            "postgres://app:***@127.0.0.1:5432/orders"
        );
        assert_eq!(redact_url("amqp://localhost"), "amqp://localhost");
        assert_eq!(
            redact_url("postgres://db/orders?user=app&password=S3cret&port=5432"),
            "postgres://db/orders?user=app&password=***&port=5432"
        );
        assert_eq!(
            redact_url("host=db user=app PASSWORD=S3cret dbname=orders"),
            "host=db user=app PASSWORD=*** dbname=orders"
        );
        assert_eq!(
            redact_url(r"host=db password='a b\' c' dbname=orders"),
            "host=db password=*** dbname=orders"
        );
        // tokio-postgres takes spaces around the `=` too.
        assert_eq!(
            redact_url("host=db user=app password = S3cret dbname=orders"),
            "host=db user=app password = *** dbname=orders"
        );
        assert_eq!(
            redact_url("host=password-db sslpassword  =  'x y' password=S3cret"),
            "host=password-db sslpassword  =  *** password=***"
        );
    }

    #[test]
    fn text_that_looks_like_a_number_stays_text_and_numbers_still_parse() {
        let defaults = Demo {
            database: DatabaseSettings::local("orders"),
            http: HttpSettings::local(8080),
            name: "x".into(),
        };
        std::env::set_var("KIT_SETTINGS_TEXT_TEST__NAME", "007");
        std::env::set_var("KIT_SETTINGS_TEXT_TEST__DATABASE__POOL_SIZE", "3");
        let loaded: Demo = load("KIT_SETTINGS_TEXT_TEST", &defaults).expect("load");
        assert_eq!(loaded.name, "007");
        assert_eq!(loaded.database.pool_size, 3);
    }

    /// Settings without defaults: a number and a text.
    #[derive(Debug, Default, Serialize, Deserialize)]
    struct Optional {
        retention_secs: Option<u64>,
        name: Option<String>,
    }

    #[test]
    fn a_word_of_yes_or_no_is_refused_for_a_number() {
        let defaults = Demo {
            database: DatabaseSettings::local("orders"),
            http: HttpSettings::local(8080),
            name: "x".into(),
        };
        let vars = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect::<Vec<_>>()
                .into_iter()
        };
        for word in ["yes", "On", " true ", "no", "OFF", "false"] {
            let error = reject_words_for_numbers(
                "SVC",
                &defaults,
                vars(&[("SVC__DATABASE__POOL_SIZE", word)]),
            )
            .expect_err(word)
            .to_string();
            assert!(
                error.contains(&format!(
                    "SVC__DATABASE__POOL_SIZE={word}: a number is expected"
                )),
                "{error}"
            );
        }
        // As `load` sees it (before, it loaded a pool of 1).
        std::env::set_var("KIT_SETTINGS_WORD_TEST__DATABASE__POOL_SIZE", "yes");
        let error = load("KIT_SETTINGS_WORD_TEST", &defaults)
            .expect_err("a word for a number")
            .to_string();
        assert!(error.contains("a number is expected"), "{error}");
        // A number setting without a default (null in the defaults) too.
        let none = Optional::default();
        std::env::set_var("KIT_SETTINGS_OPTIONAL_TEST__RETENTION_SECS", "on");
        let error = load("KIT_SETTINGS_OPTIONAL_TEST", &none)
            .expect_err("a word for an optional number")
            .to_string();
        assert!(
            error.contains("KIT_SETTINGS_OPTIONAL_TEST__RETENTION_SECS=on: a number is expected"),
            "{error}"
        );
        std::env::set_var("KIT_SETTINGS_OPTIONAL_TEST__RETENTION_SECS", "7");
        std::env::set_var("KIT_SETTINGS_OPTIONAL_TEST__NAME", "yes");
        let loaded = load("KIT_SETTINGS_OPTIONAL_TEST", &none).expect("a number, and a text");
        assert_eq!(
            (loaded.retention_secs, loaded.name.as_deref()),
            (Some(7), Some("yes"))
        );
        // Numbers, text settings and other prefixes are left to config.
        assert!(reject_words_for_numbers(
            "SVC",
            &defaults,
            vars(&[
                ("SVC__DATABASE__POOL_SIZE", "3"),
                ("SVC__NAME", "yes"),
                ("OTHER__HTTP__PORT", "on"),
            ]),
        )
        .is_ok());
    }

    #[test]
    fn a_file_key_that_names_no_setting_or_a_word_for_a_number_is_refused() {
        let defaults = Demo {
            database: DatabaseSettings::local("orders"),
            http: HttpSettings::local(8080),
            name: "x".into(),
        };
        let file = |name: &str, text: &str| {
            let path = std::env::temp_dir()
                .join(format!("kit-settings-{}-{name}.toml", std::process::id()));
            std::fs::write(&path, text).expect("write the file");
            path.to_str().expect("utf-8 path").to_owned()
        };
        let good = file(
            "good",
            "name = \"z\"\n[database]\npool_size = 4\nurl = \"postgres://db/x\"\n",
        );
        reject_unknown_file_settings(&good, &defaults, &defaults).expect("every key a setting");
        // As `load` reads it.
        std::env::set_var("KIT_SETTINGS_FILE_TEST__CONFIG_FILE", &good);
        let loaded: Demo = load("KIT_SETTINGS_FILE_TEST", &defaults).expect("load");
        assert_eq!((loaded.database.pool_size, loaded.name.as_str()), (4, "z"));
        for (name, text, expected) in [
            (
                "typo",
                "[database]\npool_szie = 4\n",
                "database.pool_szie names no setting",
            ),
            (
                "section",
                "[databse]\nurl = \"x\"\n",
                "databse.url names no setting",
            ),
            (
                "word",
                "[database]\npool_size = \"yes\"\n",
                "database.pool_size = \"yes\": a number is expected",
            ),
            (
                "boolean",
                "[database]\npool_size = true\n",
                "database.pool_size = true: a number is expected",
            ),
            (
                "capitals",
                "[DATABASE]\nURL = \"postgres://db/x\"\n",
                "DATABASE.URL names no setting",
            ),
        ] {
            let path = file(name, text);
            let error = reject_unknown_file_settings(&path, &defaults, &defaults)
                .expect_err(name)
                .to_string();
            assert!(error.contains(expected), "{name}: {error}");
            assert!(error.contains("database.acquire_timeout_ms"), "{error}");
            // As `load` reads it (before, it loaded the defaults, or a pool
            // of 1).
            let prefix = format!("KIT_SETTINGS_FILE_{}", name.to_uppercase());
            std::env::set_var(format!("{prefix}__CONFIG_FILE"), &path);
            let error = load(&prefix, &defaults).expect_err(name).to_string();
            assert!(error.contains(expected), "{name}: {error}");
            std::fs::remove_file(&path).expect("remove");
        }
        std::fs::remove_file(&good).expect("remove");
        // A number setting without a default (null in the defaults): before,
        // `retention_secs = "on"` loaded as 1.
        let none = Optional::default();
        for (name, text, expected) in [
            (
                "optional-word",
                "retention_secs = \"on\"\n",
                "retention_secs = \"on\": a number is expected",
            ),
            (
                "optional-boolean",
                "retention_secs = true\n",
                "retention_secs = true: a number is expected",
            ),
        ] {
            let path = file(name, text);
            let prefix = format!(
                "KIT_SETTINGS_FILE_{}",
                name.to_uppercase().replace('-', "_")
            );
            std::env::set_var(format!("{prefix}__CONFIG_FILE"), &path);
            let error = load(&prefix, &none).expect_err(name).to_string();
            assert!(error.contains(expected), "{name}: {error}");
            std::fs::remove_file(&path).expect("remove");
        }
        let path = file("optional-good", "retention_secs = 7\nname = \"yes\"\n");
        std::env::set_var("KIT_SETTINGS_FILE_OPTIONAL_GOOD__CONFIG_FILE", &path);
        let loaded = load("KIT_SETTINGS_FILE_OPTIONAL_GOOD", &none).expect("a number, and a text");
        assert_eq!(
            (loaded.retention_secs, loaded.name.as_deref()),
            (Some(7), Some("yes"))
        );
        std::fs::remove_file(&path).expect("remove");
    }

    #[test]
    fn a_variable_that_names_no_setting_is_refused() {
        let defaults = Demo {
            database: DatabaseSettings::local("orders"),
            http: HttpSettings::local(8080),
            name: "x".into(),
        };
        let vars = |names: &[&str]| {
            names
                .iter()
                .map(|n| (*n).to_owned())
                .collect::<Vec<_>>()
                .into_iter()
        };
        let known = [
            "SVC__DATABASE__URL",
            "SVC__HTTP__PORT",
            "SVC__HTTP__WORKERS",
            "SVC__NAME",
            "SVC__CONFIG_FILE",
            "SVC_API_KEY",
            "OTHER__X",
        ];
        reject_unknown_variables("SVC", &defaults, vars(&known)).expect("all known");
        for typo in [
            "SVC__DATABASE_URL",
            "SVC__HTTP__PROT",
            "SVC__DATABASE",
            "svc__http__prot",
        ] {
            let error = reject_unknown_variables("SVC", &defaults, vars(&[typo]))
                .expect_err(typo)
                .to_string();
            assert!(error.contains(typo), "{error}");
            assert!(error.contains("SVC__DATABASE__POOL_SIZE"), "{error}");
        }
    }
}
