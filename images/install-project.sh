#!/bin/sh
# In a build stage: installs kvpilot from /src into /opt/kvpilot/venv without its dependencies
# (the deps stage has them) and copies the files it added (the package, its metadata, the
# `kvpilot` script) under /stage, which the final image copies over its venv.
set -eu
VENV=/opt/kvpilot/venv
python3 -m pip install -q --no-deps /src
SITE="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "/stage$SITE" "/stage$VENV/bin"
cp -a "$SITE/kvpilot" "$SITE"/kvpilot-*.dist-info "/stage$SITE/"
cp -a "$VENV/bin/kvpilot" "/stage$VENV/bin/"
