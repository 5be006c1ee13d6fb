#!/usr/bin/env bash
# Debian packages the test suite needs (a real browser for the dashboard test, a real PostgreSQL for multi-worker
# tests). Installed only when missing and when we can (root + apt-get); otherwise the tests that need them say so.
set -euo pipefail
need=()
for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "system_deps: missing ${need[*]} (install them with apt-get)" >&2; exit 0
fi
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
