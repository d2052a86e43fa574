#!/usr/bin/env bash
# The servers the test suite runs beyond .venv: PostgreSQL (behind the shared MLflow server test)
# and Prometheus (the monitoring test), and iproute2 (`ip`, for the hosts of test_hosts), from
# Debian's packages. `make test` runs this first; it
# installs nothing when both are there. The tests start and stop their own instances.
set -euo pipefail

need=()
command -v prometheus >/dev/null || need+=(prometheus)
PATH="$PATH:/usr/sbin:/sbin" command -v ip >/dev/null || need+=(iproute2)
if ! { command -v initdb && command -v pg_ctl; } >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need+=(postgresql)
fi
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "The test suite needs: ${need[*]} (Debian package names). Install them, then run make test again." >&2
  exit 1
fi
echo "installing ${need[*]} for the test suite (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}
# The packages start their own services where systemd runs; the tests start their own on loopback.
for service in prometheus postgresql; do
  systemctl disable --now "$service" >/dev/null 2>&1 || true
done
