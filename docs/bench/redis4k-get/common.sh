# Sourced by reorder.sh and profile.sh: a fresh redis-server in ncperf-b on PORT, its 4 KiB key
# set by a small SET from ncperf-a. PRE: "" for kernel TCP, "NETCHANNEL run --" for netchannel.
# Leaves the server's pid in `spid`.
start_server_with_key() { # PRE PORT
  local pre=$1 port=$2
  ip netns exec ncperf-b $pre redis-server --bind 10.214.0.2 --port "$port" --save "" \
    --appendonly no --protected-mode no >/dev/null 2>&1 &
  spid=$!
  sleep 2
  ip netns exec ncperf-a $pre redis-benchmark -h 10.214.0.2 -p "$port" -c 50 -P 16 -t set \
    -n 1000 -d 4096 -q >/dev/null 2>&1
}
