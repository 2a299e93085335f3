#!/usr/bin/env bash
# Install a headless browser (Debian's `chromium`) so that the report tests check the page in a
# real browser. Called by .ci/run before `make test`.
#
# It never fails CI: where the browser cannot be installed (no apt-get, not root and no sudo, no
# network, a distribution without the package) it says why on one line, writes that reason to
# .make/browser-unavailable (the browser tests skip with it), and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .make
reason_file=.make/browser-unavailable

unavailable() {
    echo "install_browser: no browser: $1; the headless-browser tests will skip" >&2
    printf '%s\n' "$1" > "$reason_file"
    exit 0
}

for exe in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$exe" >/dev/null 2>&1; then
        echo "install_browser: $(command -v "$exe") is already installed"
        rm -f "$reason_file"
        exit 0
    fi
done

command -v apt-get >/dev/null 2>&1 || unavailable "apt-get is not available on this machine (install chromium by hand)"
if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
else
    unavailable "installing chromium needs root (or password-less sudo)"
fi

log=.make/install_browser.log
export DEBIAN_FRONTEND=noninteractive
echo "install_browser: apt-get install chromium (log: $log)"
# Bounded: a slow mirror must not eat CI's time budget.
if ! timeout 300 "${sudo[@]}" apt-get update >"$log" 2>&1; then
    unavailable "apt-get update failed ($(tail -n 1 "$log"))"
fi
if ! timeout 600 "${sudo[@]}" apt-get install -y --no-install-recommends chromium >>"$log" 2>&1; then
    unavailable "apt-get install chromium failed ($(tail -n 1 "$log"))"
fi
command -v chromium >/dev/null 2>&1 || unavailable "apt-get installed chromium but no chromium command is on PATH"
rm -f "$reason_file"
echo "install_browser: installed $(chromium --version 2>/dev/null || echo chromium)"
