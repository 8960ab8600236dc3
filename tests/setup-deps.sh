#!/usr/bin/env bash
# What three test suites need beyond Python and PostgreSQL, installed where it
# can be: called by `./dev test` before pytest, and by .ci/run (with
# --require-all), so the two cannot drift.
#
#   tests/behind_pgbouncer   the `pgbouncer` binary on PATH (Debian package pgbouncer);
#                            so does tests/contract's pgbouncer backend
#   tests/console (browser)  Chromium at $AGENT_INBOX_TEST_CHROMIUM, default
#                            /usr/bin/chromium (Debian package chromium)
#   tests/citus              the Citus extension for the local PostgreSQL: citus.so
#                            and citus.control, installed from
#                            ../shared/citus/citus-pg<major>-*.tar.gz by its install.sh;
#                            so does tests/contract's citus backend
#
# The checks are the tests' own (tests/pgbouncer.py available(),
# tests/console/conftest.py CHROMIUM, pgserver.citus_installed()). What is
# missing is installed when this runs as root with apt-get (one `apt-get update`,
# one `apt-get install`), the Citus extension when ../shared/citus/ is there too.
# Whatever is still missing is named on one line, with the command that would
# enable it; pytest then skips those tests, saying why.
#
#   --require-all                  exit 1 if anything is still missing (CI)
#   AGENT_INBOX_TEST_NO_INSTALL=1  install nothing; only check and report
#   AGENT_INBOX_SHARED_DIR         where shared/ is (default: ../shared beside
#                                  the repository)
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
shared=${AGENT_INBOX_SHARED_DIR:-$repo/../shared}
[ -d "$shared" ] && shared=$(cd "$shared" && pwd)
chromium=${AGENT_INBOX_TEST_CHROMIUM:-/usr/bin/chromium}
require_all=0
for arg in "$@"; do
  case "$arg" in
    --require-all) require_all=1 ;;
    *) echo "usage: tests/setup-deps.sh [--require-all]" >&2; exit 2 ;;
  esac
done

say() { echo "test set-up: $*" >&2; }

may_install=1
why_not=""
if [ -n "${AGENT_INBOX_TEST_NO_INSTALL:-}" ] && [ "${AGENT_INBOX_TEST_NO_INSTALL}" != 0 ]; then
  may_install=0; why_not="AGENT_INBOX_TEST_NO_INSTALL is set"
elif [ "$(id -u)" != 0 ]; then
  may_install=0; why_not="not root"
fi
has_apt=0
command -v apt-get >/dev/null 2>&1 && has_apt=1

# pgserver.find_bindir(): pg_ctl's real directory if it holds initdb and
# postgres, else the newest /usr/lib/postgresql/*/bin that does.
pg_bindir() {
  local found dir
  found=$(command -v pg_ctl 2>/dev/null) && dir=$(dirname "$(realpath "$found")") &&
    [ -e "$dir/initdb" ] && [ -e "$dir/postgres" ] && { echo "$dir"; return 0; }
  for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5,5nr); do
    [ -e "$dir/initdb" ] && [ -e "$dir/postgres" ] && { echo "$dir"; return 0; }
  done
  return 1
}

bindir=$(pg_bindir) || bindir=""
pg_major=""
[ -n "$bindir" ] && pg_major=$(basename "$(dirname "$bindir")")

have_pgbouncer() { command -v pgbouncer >/dev/null 2>&1; }
have_chromium() { [ -e "$chromium" ]; }
# pgserver.citus_installed(): <bindir>/../lib/citus.so and
# <prefix>/share/postgresql/<major>/extension/citus.control (/usr/lib/postgresql/15/bin
# -> /usr/share/postgresql/15)
have_citus() {
  [ -n "$bindir" ] || return 1
  local prefix
  prefix=$(dirname "$(dirname "$(dirname "$(dirname "$bindir")")")")
  [ -e "$bindir/../lib/citus.so" ] && [ -e "$prefix/share/postgresql/$pg_major/extension/citus.control" ]
}
citus_tarball() {
  [ -n "$pg_major" ] || return 1
  ls "$shared"/citus/citus-pg"$pg_major"-*.tar.gz 2>/dev/null | sort -V | tail -n 1 | grep .
}

log=$(mktemp "${TMPDIR:-/tmp}/agent-inbox-test-setup.XXXXXX")
trap 'rm -f "$log"' EXIT
run_logged() {  # run a command, its output to $log; on failure show the tail
  if ! "$@" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    say "failed: $*"
    return 1
  fi
}

# --- the Debian packages: one update, one install -----------------------------
packages=()
have_pgbouncer || packages+=(pgbouncer)
have_chromium || packages+=(chromium)
if [ ${#packages[@]} -gt 0 ] && [ $may_install = 1 ] && [ $has_apt = 1 ]; then
  say "installing ${packages[*]} (apt-get; takes a few minutes the first time)"
  export DEBIAN_FRONTEND=noninteractive
  run_logged apt-get update && run_logged apt-get install -y "${packages[@]}"
fi

# --- the Citus extension, from a copy of ../shared/citus (read-only in CI) ----
if ! have_citus && [ $may_install = 1 ] && tarball=$(citus_tarball); then
  say "installing the Citus extension from $tarball"
  citus_tmp=$(mktemp -d)
  cp "$tarball" "$shared/citus/install.sh" "$citus_tmp"/
  [ -e "$tarball.sha256" ] && cp "$tarball.sha256" "$citus_tmp"/
  ( cd "$citus_tmp" && run_logged bash ./install.sh "./$(basename "$tarball")" )
  rm -rf "$citus_tmp"
fi

# --- what is still missing, on one line ---------------------------------------
skipped=()
hints=()
hint() {  # add a hint once
  local h
  for h in "${hints[@]}"; do [ "$h" = "$1" ] && return; done
  hints+=("$1")
}
apt_hint() {  # the way to the Debian package $1
  if [ $has_apt = 0 ]; then hint "install $1 with the system's package manager"
  elif [ $may_install = 0 ] && [ "$why_not" = "not root" ]; then hint "sudo tests/setup-deps.sh"
  elif [ $may_install = 0 ]; then hint "unset AGENT_INBOX_TEST_NO_INSTALL"
  else hint "see apt-get's failure above"
  fi
}
have_pgbouncer || { skipped+=("tests/behind_pgbouncer and tests/contract[pgbouncer] (no pgbouncer on PATH)"); apt_hint pgbouncer; }
have_chromium || { skipped+=("tests/console browser tests (no Chromium at $chromium)"); apt_hint chromium; }
if ! have_citus; then
  skipped+=("tests/citus and tests/contract[citus] (no Citus extension for PostgreSQL ${pg_major:-?})")
  if [ -z "$bindir" ]; then hint "install the PostgreSQL server binaries"
  elif ! citus_tarball >/dev/null; then
    hint "put shared/ (with citus/citus-pg$pg_major-*.tar.gz) at $shared"
  elif [ $may_install = 0 ] && [ "$why_not" = "not root" ]; then hint "sudo tests/setup-deps.sh"
  elif [ $may_install = 0 ]; then hint "unset AGENT_INBOX_TEST_NO_INSTALL"
  else hint "see install.sh's failure above"
  fi
fi

if [ ${#skipped[@]} -eq 0 ]; then
  say "pgbouncer, Chromium and the Citus extension present: no suite is skipped for want of them"
  exit 0
fi
join() { local sep=$1 out=$2; shift 2; for x in "$@"; do out+="$sep$x"; done; echo "$out"; }
say "skipping $(join ", " "${skipped[@]}"); to run them: $(join "; " "${hints[@]}")"
[ $require_all = 1 ] && exit 1
exit 0
