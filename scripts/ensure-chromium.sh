#!/usr/bin/env bash
# Headless Chromium for the HTML report's browser test (Debian's package; never a
# downloaded build): installed with apt-get when /usr/bin/chromium is missing and this runs
# as root. Only the test targets call it (`make test`, `.ci/run`); a fleet never needs it.
set -u
# CHROMIUM_PATH: the file looked for (default /usr/bin/chromium, where the package puts it).
if [ ! -x "${CHROMIUM_PATH:-/usr/bin/chromium}" ]; then
  echo "installing chromium (Debian package)"
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
      >/tmp/ensure-chromium.log 2>&1 || echo "warning: chromium did not install; see /tmp/ensure-chromium.log" >&2
  else
    echo "warning: ${CHROMIUM_PATH:-/usr/bin/chromium} is missing; run as root: apt-get install chromium" >&2
  fi
fi
