#!/usr/bin/env bash
# `make test`, `make soak`, `make bench*` and `make run` start services of
# their own. The services of a `make run` still running, or left behind by
# one that was killed (its Ctrl-C trap never ran), would take the tests', the
# soak's or the bench's events (that relay has no tenant filter and claims
# every tenant's outbox rows) or hold a new `make run`'s ports. Refuse,
# naming them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pids_file=.run/services.pids
[ -s "$pids_file" ] || exit 0
alive=()
while read -r pid name; do
    [ -n "${pid:-}" ] || continue
    # The pid is still that service (not a pid reused by another process).
    if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$name"; then
        alive+=("$pid")
    fi
done <"$pids_file"
if [ "${#alive[@]}" -eq 0 ]; then
    rm -f "$pids_file"
    exit 0
fi
echo "the services of \`make run\` are still running (pids ${alive[*]}): make run, make test, make soak and make bench* start their own (and that relay, with no tenant filter, would claim their outbox rows)." >&2
echo "Stop them first: Ctrl-C in make run's terminal, or: kill ${alive[*]}" >&2
exit 1
