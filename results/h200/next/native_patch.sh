#!/usr/bin/env bash
# Native's allocator with expandable segments (native_expandable_segments.patch beside this file), not
# landed until a GPU has run it: applied to the device's copy of the tree for the whole run (its points
# then name a dirty tree), its GPU tests first; unless they all pass (none failed, none skipped), it is
# taken back out, so that no point of the run uses it untested. Exit status 0 only when the copy now
# holds it, tested. Used by x2_calls.sh and ../../h200x4/next/calls.sh before they detach.
#   bash results/h200/next/native_patch.sh OUT_DIR     (the tests' output: OUT_DIR/pytest_native_segments.txt)
patch=results/h200/next/native_expandable_segments.patch
git apply --check $patch 2>/dev/null || exit 1  # landed already, or no longer applies: nothing to do
git apply $patch
timeout 120 python3 -m pytest -q tests/test_gpu.py -k "native_grows or allocator" > "$1/pytest_native_segments.txt" 2>&1
rc=$? && tail -2 "$1/pytest_native_segments.txt"
grep -q skipped "$1/pytest_native_segments.txt" && rc=skipped
[ "$rc" = 0 ] || { git apply -R $patch; echo "native's patch taken back out: its GPU tests gave $rc"; exit 1; }
