#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine. Idempotent: installs only what is
# missing, so a second run does nothing and needs no network.
set -euo pipefail

need_apt=()
have() { command -v "$1" >/dev/null 2>&1; }
have ip || need_apt+=(iproute2)
have perf || need_apt+=(linux-perf)
have iperf3 || need_apt+=(iperf3)
have sockperf || need_apt+=(sockperf)
have cc || need_apt+=(gcc)
have ethtool || need_apt+=(ethtool)
# Real programs run under `netchannel run` by the interposition tests (issue 10).
have redis-server || need_apt+=(redis-server)
have redis-benchmark || need_apt+=(redis-tools)
have memcached || need_apt+=(memcached)
have memcslap || need_apt+=(libmemcached-tools)
have nginx || need_apt+=(nginx-light)
have wrk || need_apt+=(wrk)
have curl || need_apt+=(curl) # the nginx test fetches its file with it
# PostgreSQL (a forking server) with pgbench; haproxy (accepts and connects in one event loop).
# Debian keeps PostgreSQL's programs in /usr/lib/postgresql/VERSION/bin.
compgen -G '/usr/lib/postgresql/*/bin/pgbench' >/dev/null || need_apt+=(postgresql)
have haproxy || need_apt+=(haproxy)
have node || need_apt+=(nodejs) # libuv's event loop (the node test)
have javac || need_apt+=(default-jdk-headless) # the java test (source-file launch needs javac's module)
have python3 || need_apt+=(python3) # scripts/sched-trace.py, the dual-stack listener test
have socat || need_apt+=(socat) # docs/bench/short-lived/run.sh (a server that forks per connection)
have valgrind || need_apt+=(valgrind) # docs/bench/guard-wakes/callgrind.sh (instructions per key)
# docs/bench/probing-11-29: programs tried as a user would (rsync daemon, netcat, iperf 2, lighttpd + ab).
have rsync || need_apt+=(rsync)
have nc || need_apt+=(netcat-openbsd)
have iperf || need_apt+=(iperf)
have lighttpd || need_apt+=(lighttpd)
have ab || need_apt+=(apache2-utils)
[[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]] || need_apt+=(fonts-dejavu-core)

if ((${#need_apt[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing packages ${need_apt[*]}; run as root or install them" >&2
    exit 1
  fi
  echo "setup: installing ${need_apt[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # No service autostart: the tests run their own servers on their own ports.
  own_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  if ((own_policy)); then rm -f /usr/sbin/policy-rc.d; fi
fi

if ! have cargo; then
  echo "setup: cargo not found; install Rust with rustup first" >&2
  exit 1
fi
if have rustup; then
  for c in clippy rustfmt; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c" >&2
  done
fi

# perf needs permission to sample the whole machine (ncperf profile).
if [[ -w /proc/sys/kernel/perf_event_paranoid ]] && (($(cat /proc/sys/kernel/perf_event_paranoid) > 1)); then
  echo 1 >/proc/sys/kernel/perf_event_paranoid
fi
