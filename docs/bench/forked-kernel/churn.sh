#!/usr/bin/env bash
# nginx (master and 2 forked workers) under wrk -t 2 -c 16 with `Connection: close` (a new
# connection per request), between the ncperf namespaces, ROUNDS interleaved rounds of: kernel
# TCP; both sides under `netchannel run` relaying the workers' connections (--relay-forked);
# both sides under `netchannel run` as by default. Prints requests/s and the client's stats.
# Usage: churn.sh ROUNDS [SECONDS]
set -euo pipefail
rounds=$1; secs=${2:-5}
nc=$(cd "$(dirname "$0")/../../../target/release" && pwd)/netchannel
dir=$(mktemp -d)
mkdir -p "$dir/html"
head -c 4096 /dev/zero | tr '\0' x >"$dir/html/f.txt"
cat >"$dir/nginx.conf" <<CONF
daemon off; master_process on; worker_processes 2; pid $dir/nginx.pid;
error_log $dir/error.log; events { worker_connections 1024; }
http { access_log off; client_body_temp_path $dir; proxy_temp_path $dir;
fastcgi_temp_path $dir; uwsgi_temp_path $dir; scgi_temp_path $dir;
server { listen 10.214.0.2:8095; root $dir/html; } }
CONF
trap 'pkill -f "nginx -c $dir" || true' EXIT
one() {
  local label=$1; shift
  local wrap=("$@")
  ip netns exec ncperf-b "${wrap[@]}" nginx -c "$dir/nginx.conf" -p "$dir" >/dev/null 2>&1 &
  sleep 1.5
  local client=()
  [[ ${#wrap[@]} -gt 0 ]] && client=("$nc" run --stats --)
  local out
  out=$(ip netns exec ncperf-a "${client[@]}" wrk -t 2 -c 16 -d "$secs" -H "Connection: close" \
    http://10.214.0.2:8095/f.txt 2>&1)
  echo "$label: $(grep Requests/sec <<<"$out" | awk '{print $2}') requests/s" \
    "$(grep -o 'errors:.*' <<<"$out" || true)"
  { grep -o 'direct [0-9]*, relayed [0-9]*\|kernel tcp [0-9]* ([^)]*)' <<<"$out" || true; } | tr '\n' ' ' | sed 's/^/  client: /'
  echo
  pkill -f "nginx -c $dir" || true
  sleep 2
}
for r in $(seq 1 "$rounds"); do
  echo "round $r"
  one linux
  one relay-forked "$nc" run --relay-forked --
  one default "$nc" run --
done
