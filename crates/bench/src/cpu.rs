//! Where the CPU goes: user + system time of every process on the machine,
//! grouped by command name (PostgreSQL's backends, its autovacuum workers apart,
//! RabbitMQ's `beam.smp`, each service binary, the bench itself), read from `/proc/<pid>/stat`
//! before and after a measured interval. On a 2-core machine every stage
//! competes with the database and the broker for the same cores, so the CPU
//! each one spends per event is what explains a ratio.

use std::collections::BTreeMap;

use serde::Serialize;

/// Clock ticks per second of `/proc/<pid>/stat` (`sysconf(_SC_CLK_TCK)`,
/// 100 on every Linux this runs on).
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU ticks per live process: pid -> (group, ticks).
#[derive(Clone, Debug, Default)]
pub struct Snapshot(BTreeMap<u32, (String, u64)>);

/// Read every process's CPU time now.
pub fn snapshot() -> Snapshot {
    let mut processes = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Snapshot(processes);
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ... utime stime ...": comm may hold spaces.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let mut comm = group(&stat[open + 1..close]);
        if comm == "postgresql" && is_autovacuum(pid) {
            comm = AUTOVACUUM.to_owned();
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // After the comm: state is field 3 (index 0 here); utime 14, stime 15.
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
        if let (Some(user), Some(system)) = (ticks(11), ticks(12)) {
            processes.insert(pid, (comm, user + system));
        }
    }
    Snapshot(processes)
}

/// PostgreSQL's autovacuum workers, apart from its other processes: the
/// vacuuming a stage's writes cause is part of its cost, but shown on its
/// own so that a reader can tell it from the statements' own work.
const AUTOVACUUM: &str = "postgresql autovacuum";

/// Whether PostgreSQL process `pid` is an autovacuum worker or launcher
/// (its process title, in `/proc/<pid>/cmdline`; the command name is
/// `postgres` for every PostgreSQL process).
fn is_autovacuum(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|title| title.windows(10).any(|w| w == b"autovacuum"))
        .unwrap_or(false)
}

fn is_postgres(group: &str) -> bool {
    group.starts_with("postgresql")
}

/// The group a command name belongs to (the kernel truncates names to 15
/// bytes: `inventory-consu` is the inventory consumer).
fn group(comm: &str) -> String {
    match comm {
        c if c.starts_with("postgres") => "postgresql",
        c if c.starts_with("beam") || c.starts_with("erl") || c == "epmd" => "rabbitmq",
        c if c.starts_with("inventory") => "inventory-consumer",
        c if c.starts_with("ledger") => "ledger-consumer",
        c if c.starts_with("loyalty") => "loyalty-consumer",
        c if c.starts_with("outbox") => "outbox-relay",
        c if c.starts_with("order-api") => "order-api",
        c if c.starts_with("bench") || c.starts_with("tokio-runtime") => "bench (load, raw loops)",
        _ => "other",
    }
    .to_owned()
}

/// CPU seconds per group between two snapshots (processes that started in
/// between count from zero; `after` holds the last reading of every process
/// seen, see [`Meter`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Usage {
    pub seconds: BTreeMap<String, f64>,
}

impl Usage {
    pub fn between(before: &Snapshot, after: &Snapshot) -> Usage {
        let mut seconds: BTreeMap<String, f64> = BTreeMap::new();
        for (pid, (group, ticks)) in &after.0 {
            // The same process: the same pid and group, or a PostgreSQL
            // process whose title went blank as it exited (its autovacuum
            // reading then still counts from where it was).
            let earlier = before
                .0
                .get(pid)
                .filter(|(g, _)| g == group || (is_postgres(g) && is_postgres(group)))
                .map(|(_, t)| *t)
                .unwrap_or(0);
            let delta = ticks.saturating_sub(earlier);
            if delta > 0 {
                *seconds.entry(group.clone()).or_default() += delta as f64 / TICKS_PER_SECOND;
            }
        }
        seconds.remove("other");
        Usage { seconds }
    }

    /// The CPU of both intervals.
    pub fn plus(mut self, other: Usage) -> Usage {
        for (group, seconds) in other.seconds {
            *self.seconds.entry(group).or_default() += seconds;
        }
        self
    }

    /// "postgresql 41 µs, rabbitmq 35 µs, ..." per event, largest first.
    pub fn per_event(&self, events: u64) -> String {
        let mut groups: Vec<(&String, &f64)> = self.seconds.iter().collect();
        groups.sort_by(|a, b| b.1.total_cmp(a.1));
        groups
            .iter()
            .map(|(group, seconds)| {
                format!("{group} {:.0} µs", **seconds * 1e6 / events.max(1) as f64)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Measure the CPU of an interval: `let meter = Meter::start(); ...;
/// meter.stop()`. Samples every 100 ms in the background and keeps each
/// process's last reading, so processes that exit during the interval (the
/// raw loops' connections close when they finish) still count, up to their
/// last 100 ms.
pub struct Meter {
    before: Snapshot,
    seen: std::sync::Arc<std::sync::Mutex<Snapshot>>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Meter {
    pub fn start() -> Meter {
        let before = snapshot();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(before.clone()));
        let sampler = {
            let seen = seen.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    let now = snapshot();
                    if let Ok(mut seen) = seen.lock() {
                        seen.0.extend(now.0);
                    }
                }
            })
        };
        Meter {
            before,
            seen,
            sampler,
        }
    }

    pub fn stop(self) -> Usage {
        self.sampler.abort();
        let mut last = self
            .seen
            .lock()
            .map(|seen| seen.clone())
            .unwrap_or_default();
        last.0.extend(snapshot().0);
        Usage::between(&self.before, &last)
    }
}

/// Wait until `group` used less than `cores` of a core over 250 ms (or
/// `at_most` has passed); how long it took.
pub async fn wait_quiet(
    group: &str,
    cores: f64,
    at_most: std::time::Duration,
) -> std::time::Duration {
    let window = std::time::Duration::from_millis(250);
    let started = std::time::Instant::now();
    loop {
        let before = snapshot();
        tokio::time::sleep(window).await;
        let used = Usage::between(&before, &snapshot())
            .seconds
            .get(group)
            .copied()
            .unwrap_or(0.0);
        if used < cores * window.as_secs_f64() || started.elapsed() >= at_most {
            return started.elapsed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_of_two_intervals_adds_up_per_group() {
        let a = Usage {
            seconds: BTreeMap::from([
                ("postgresql".to_owned(), 1.5),
                ("order-api".to_owned(), 0.5),
            ]),
        };
        let b = Usage {
            seconds: BTreeMap::from([
                ("postgresql".to_owned(), 2.0),
                ("rabbitmq".to_owned(), 0.25),
            ]),
        };
        let both = a.plus(b);
        assert_eq!(
            both.seconds,
            BTreeMap::from([
                ("order-api".to_owned(), 0.5),
                ("postgresql".to_owned(), 3.5),
                ("rabbitmq".to_owned(), 0.25),
            ])
        );
    }
}
