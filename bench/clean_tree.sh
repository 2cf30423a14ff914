#!/usr/bin/env bash
# A device call that runs the COMMITTED tree (HEAD), not the working tree: the device tool sends the
# working tree, which helpers may be editing. Here: writes .clean/head.tgz (HEAD without bench/results
# and the built-in checkpoints) and .clean/run.sh; carry [".whl", ".clean"] and start the command with
#   bash .clean/run.sh env DHISPARSE_COMMIT=<hash> ... bash bench/gpu_call.sh bash bench/gpu_session.sh STEPS
# run.sh unpacks HEAD into /tmp/clean, links the working tree's checkpoints, results, wheels and Triton
# cache (.tcache, so bench/gpu_call.sh finds it), and runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.clean/' .git/info/exclude || echo /.clean/ >> .git/info/exclude
mkdir -p .clean
git archive HEAD --format=tar -- $(git ls-files | grep -v -E '^(bench/results/|dhisparse/models/builtin/)') | gzip -1 > .clean/head.tgz
cat > .clean/run.sh <<'RUN'
#!/usr/bin/env bash
set -u
W=$PWD; C=/tmp/clean; rm -rf $C; mkdir -p $C; tar xzf .clean/head.tgz -C $C
mkdir -p $C/dhisparse/models $C/bench; ln -sfn $W/dhisparse/models/builtin $C/dhisparse/models/builtin
ln -sfn $W/bench/results $C/bench/results; ln -sfn $W/.whl $C/.whl; ln -sfn $W/.tcache $C/.tcache
cd $C && "$@"
RUN
chmod +x .clean/run.sh
echo "HEAD $(git rev-parse --short HEAD) -> .clean/head.tgz ($(du -h .clean/head.tgz | cut -f1))"
