# apt_get ARGS...: apt-get that waits for another apt/dpkg to let go of its lock.
#
# Sourced by scripts/setup.sh. A fresh machine often runs unattended-upgrades
# at boot; apt-get then fails at once with "Could not get lock". Retry every
# APT_LOCK_POLL_S seconds for up to GLASSBOX_APT_LOCK_TIMEOUT_S (default 600),
# then fail with one line that says who holds the lock.

APT_LOCK_POLL_S="${APT_LOCK_POLL_S:-5}"

apt_get() {
    local timeout="${GLASSBOX_APT_LOCK_TIMEOUT_S:-600}"
    local start_ms err rc
    # Milliseconds, not bash's $SECONDS: that counter ticks on whole seconds,
    # so a 1 s budget could run out a few ms after the first attempt.
    start_ms=$(date +%s%3N)
    err="$(mktemp)"
    while true; do
        printf '+ apt-get %s\n' "$*"
        rc=0
        # stderr to a file first, then shown: a tee in a process substitution
        # could still be writing the file when grep reads it (seen under load).
        apt-get "$@" 2>"$err" || rc=$?
        cat "$err" >&2
        if [ "$rc" -eq 0 ]; then
            rm -f "$err"
            return 0
        fi
        if ! grep -qE 'Could not get lock|Unable to acquire the dpkg|is another process using it' "$err"; then
            rm -f "$err"
            return "$rc"
        fi
        if [ $(($(date +%s%3N) - start_ms)) -ge $((timeout * 1000)) ]; then
            echo "error: apt-get still locked after ${timeout}s by another apt/dpkg" \
                "($(grep -oE 'held by process [0-9]+ \([^)]*\)' "$err" | head -1 || true));" \
                "wait for it to finish (or set GLASSBOX_APT_LOCK_TIMEOUT_S) and run make setup again" >&2
            rm -f "$err"
            return 1
        fi
        echo "apt/dpkg is busy (another install or unattended-upgrades); retrying in" \
            "${APT_LOCK_POLL_S}s (gives up after ${timeout}s)" >&2
        sleep "$APT_LOCK_POLL_S"
    done
}
