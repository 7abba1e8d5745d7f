#!/usr/bin/env bash
# Fault-injection helpers (the same functions exist in infra-env.sh once sourced):
#   scripts/infra-restart.sh pg [immediate|fast|smart]   # immediate = crash + crash recovery
#   scripts/infra-restart.sh rabbitmq [app|full]         # app = stop_app/start_app, full = node stop/start
#   scripts/infra-restart.sh rabbitmq-alarm on|off       # memory alarm: publishers blocked / released
# The restarts wait until the service is ready again (exit non-zero otherwise).
set -euo pipefail
# shellcheck source=scripts/infra-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/infra-env.sh"
cd /
case "${1:-}" in
    pg|postgres)     pg_restart "${2:-immediate}" ;;
    rabbitmq|rabbit) rabbitmq_restart "${2:-app}" ;;
    rabbitmq-alarm)  rabbitmq_memory_alarm "${2:-}"; echo "memory alarm ${2:-}"; exit ;;
    *) sed -n '2,5p' "$0" >&2; exit 2 ;;
esac
echo "restarted ${1}${2:+ ($2)}"
