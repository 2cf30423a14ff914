#!/usr/bin/env bash
# Room in the device tool's 64-MiB carry (the working tree plus the carried paths: .whl 11 MB, .peer 1.1 MB) as
# bench/results grows (session 50: the tree alone was 56.4 MB). The results a device call does not read leave the
# working tree for the call and come back from HEAD after it:
#   bash bench/carry_room.sh out [N]   delete the N (default 20) largest committed, unmodified files of
#                                      bench/results (never one with uncommitted changes, never a locality_*
#                                      file: tests/test_faithful_model.py reads one)
#   bash bench/carry_room.sh in        restore every deleted tracked file under bench/results from HEAD
# Only committed bytes are removed, so a session cut off between the two loses nothing: `in` (or git) restores them.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  out)
    git ls-files -z bench/results | xargs -0 du -b | sort -n | awk '{print $2}' | grep -v '/locality_' \
      | while read -r f; do git diff --quiet HEAD -- "$f" && echo "$f"; done | tail -n "${2:-20}" \
      | while read -r f; do rm -- "$f"; done ;;
  in)
    git ls-files -d -z -- bench/results | xargs -0 -r git checkout HEAD -- ;;
  *) echo "usage: bash bench/carry_room.sh out [N] | in" >&2; exit 2 ;;
esac
echo "tree: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
