"""Whether a package index serves torch: docker/build.sh and docker/wheelhouse.sh ask before they rely on it.

    python3 docker/index_answers.py INDEX_URL [CA_BUNDLE]

Exit 0 when INDEX_URL/torch/ answers within 20 s; otherwise print why, as "  (INDEX_URL: reason)", and exit 1.
"""
import ssl
import sys
import urllib.request

url, ca = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
try:
    urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=20, context=ssl.create_default_context(cafile=ca or None))
except Exception as e:  # noqa: BLE001 - any failure means: do not rely on this index
    print(f"  ({url}: {e})")
    sys.exit(1)
