#!/usr/bin/env bash
# A headless Chromium for the tests that open HTML pages in a real browser (tests/trainer/test_report.py),
# from the Debian packages, without installing anything: `apt-get download` fetches chromium-headless-shell
# and the packages apt would install beside it (those this machine lacks), `dpkg-deb -x` unpacks them into
#   ${KUBETUNE_CACHE:-~/.cache/kubetune}/chromium-headless-shell-<version>/
# and bin/chromium-headless-shell there is a wrapper that runs the browser with the LD_LIBRARY_PATH the
# unpacked libraries need. The wrapper's path is recorded in <cache>/chromium-headless-shell.path, where
# the tests look for it (or KUBETUNE_CHROMIUM). A directory with a `.done` marker is reused.
# No root needed: apt-get only reads this machine's package lists (`apt-get -s` simulates).
set -euo pipefail
package=chromium-headless-shell
cache="${KUBETUNE_CACHE:-$HOME/.cache/kubetune}"
pointer="$cache/$package.path"

for tool in apt-get apt-cache dpkg-deb dpkg-query; do
  command -v "$tool" >/dev/null || { echo "devcluster/chromium.sh: $tool is not installed (needs a Debian-based machine)" >&2; exit 1; }
done

# apt as this machine has it configured; where its package lists are missing (images that delete
# /var/lib/apt/lists) or lack the browser, lists of our own fetched into the cache (no root needed).
apt=()
candidate() { apt-cache "${apt[@]}" policy "$package" 2>/dev/null | awk '/Candidate:/ {print $2}'; }
version="$(candidate)"
if [ -z "$version" ] || [ "$version" = "(none)" ]; then
  lists="$cache/apt"
  mkdir -p "$lists/lists/partial" "$lists/cache/archives/partial"
  apt=(-o "Dir::State::Lists=$lists/lists" -o "Dir::Cache=$lists/cache" -o Debug::NoLocking=1)
  echo "$package: not in this machine's package lists; fetching lists into $lists"
  apt-get -q "${apt[@]}" update >/dev/null
  version="$(candidate)"
fi
if [ -z "$version" ] || [ "$version" = "(none)" ]; then
  echo "devcluster/chromium.sh: no apt source offers $package (Debian bookworm or later carries it)" >&2
  exit 1
fi
# The version apt would install now (bookworm-security carries 156.x); the cache is keyed by it.
dest="$cache/$package-${version//[^A-Za-z0-9.+-]/_}"
wrapper="$dest/bin/$package"
mkdir -p "$cache"
if [ -f "$dest/.done" ]; then
  echo "$package $version: cached in $dest"
  echo "$wrapper" > "$pointer"
  echo "$wrapper"
  exit 0
fi

echo "$package $version: unpacking into $dest"
start=$SECONDS
rm -rf "$dest" && mkdir -p "$dest/root" "$dest/bin"
debs="$(mktemp -d)"
trap 'rm -rf "$debs"' EXIT
# What apt would install for the browser on this machine: the package and its missing dependencies
# (recommends left out). Debug::NoLocking lets a non-root user simulate.
mapfile -t needed < <(apt-get "${apt[@]}" -s -o Debug::NoLocking=1 install --no-install-recommends "$package" |
  awk '/^Inst / {print $2}')
(cd "$debs" && apt-get "${apt[@]}" download -q "${needed[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
for deb in "$debs"/*.deb; do
  dpkg-deb -x "$deb" "$dest/root"
done
binary="$dest/root/usr/lib/chromium/$package"
[ -x "$binary" ] || { echo "devcluster/chromium.sh: $binary missing after unpacking" >&2; exit 1; }

# Every unpacked folder that holds shared libraries goes on the library path, ahead of the system's.
library_path="$(find "$dest/root" -name '*.so*' -type f -printf '%h\n' | sort -u | paste -sd:)"
cat > "$wrapper" <<EOF
#!/bin/sh
# chromium-headless-shell $version unpacked by devcluster/chromium.sh (no installation).
LD_LIBRARY_PATH="$library_path\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$binary" "\$@"
EOF
chmod +x "$wrapper"
printf 'CHROMIUM=%s\nLD_LIBRARY_PATH=%s\n' "$binary" "$library_path" > "$dest/env"

# Refuse a browser that cannot start (a library still missing) here, not in a test.
if ! "$wrapper" --headless --no-sandbox --disable-gpu --dump-dom 'data:text/html,<p>ok</p>' 2>"$dest/check.log" |
    grep -q '<p>ok</p>'; then
  echo "devcluster/chromium.sh: $package does not start; see $dest/check.log" >&2
  exit 1
fi
touch "$dest/.done"
echo "$wrapper" > "$pointer"
echo "$package $version: unpacked in $((SECONDS - start)) s"
echo "$wrapper"
