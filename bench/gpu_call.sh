#!/usr/bin/env bash
# Device-call preamble/epilogue: carried wheels onto PYTHONPATH and a persistent Triton cache.
#   bash bench/gpu_call.sh CMD...   (carry [".whl"] or [".whlb", ".tcache"]; the cache comes back as $OUT/tc.txz)
# .whl/ comes from bench/device_wheels.sh (every dependency the device image lacks); to run the committed
# tree while the working tree is being edited, wrap the call with bench/clean_tree.sh's .clean/run.sh.
# Carry budget (64 MiB in all): the tree is 53 MB (session 39: bench/results 28 MB, the tiny-code
# checkpoints 21 MB; session 50: 56.4 MB, so a call carrying .whl and .peer first runs `bash bench/carry_room.sh out`
# and `... in` after it), so .whl holds transformers slimmed by bench/slim_wheel.py (3.1 MB, the model folders
# the tests import) and is built --lean (no OpenAI client: 11 MB), and .tcache fits only beside .whlb.
# Triton compiles each kernel shape once (~30-50 s for the resolver); the cache tarball carried
# between calls keeps later calls from paying that again. It comes back only under the device
# tool's 16 MiB file limit (xz keeps the text IRs small); over it, in 15 MB parts.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# .whl/ (tests and the server) or, for bench-only calls, .whlb/ (what importing the engine needs beyond the
# image: bench/device_wheels.sh --bench), which leaves room in the carry for .tcache
WD=.whl; ls .whl/*.whl >/dev/null 2>&1 || WD=.whlb
if ls $WD/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WD/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc
[ -f .tcache/tc.txz ] && tar xJf .tcache/tc.txz -C /tmp/tc
ls .tcache/tc.txz.part* >/dev/null 2>&1 && cat .tcache/tc.txz.part* | tar xJf - -C /tmp/tc
[ -f .tcache/tc.tgz ] && tar xzf .tcache/tc.tgz -C /tmp/tc
"$@"
rc=$?
[ -n "${SKIP_CACHE_OUT:-}" ] && exit $rc  # a session's last call: the cache is not needed back
# keep the cache under TC_KEEP_MB (default 250 MB raw, ~15 MB packed): the tree, the wheels and the
# cache must travel under the device tool's 64-MiB carry limit; the entries compiled longest ago go
# first (a dropped entry still in use is compiled again, which costs time, not correctness)
keep=$(( ${TC_KEEP_MB:-250} * 1024 ))
while [ "$(du -sk /tmp/tc | cut -f1)" -gt "$keep" ]; do
  oldest=$(ls -1tr -d /tmp/tc/*/ 2>/dev/null | head -1)
  [ -z "$oldest" ] && break
  rm -rf "$oldest"
done
tar cf - -C /tmp/tc . | xz -6 -T0 > "$OUT/tc.txz"
# over the 16 MiB file limit it comes back in parts (tc.txz.part00, ...; copy them all into .tcache/)
if [ "$(stat -c %s "$OUT/tc.txz")" -ge 16000000 ]; then
  split -b 15000000 -d "$OUT/tc.txz" "$OUT/tc.txz.part" && rm -f "$OUT/tc.txz"
  echo "triton cache in $(ls "$OUT"/tc.txz.part* | wc -l) parts"
fi
exit $rc
