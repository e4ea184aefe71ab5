# Shared by the benchmark scripts that start a radixserve server: source it,
# start the server in its own process group (setsid) with its pid in
# SERVER_PID, then `wait_healthy LOG`; `stop_server` runs on exit.
# Needs PY and PORT; START_TIMEOUT (s) bounds the wait.

SERVER_PID=

stop_server() {  # SIGTERM and wait; kill the process group if it hangs
    [[ -n $SERVER_PID ]] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null
    for ((i = 0; i < 40; i++)); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
}
trap stop_server EXIT

wait_healthy() {  # LOG: until /health answers; on failure print the log's tail, stop, return 1
    local deadline=$((SECONDS + ${START_TIMEOUT:-240}))
    until "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$PORT/health" 2>/dev/null; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null || ((SECONDS > deadline)); then
            echo "the server did not start:"; tail -n 20 "$1"; stop_server; return 1
        fi
        sleep 1
    done
}
