#!/usr/bin/env bash
# Probe the host's CPU AdamW throughput with and without transparent huge pages for torch's allocator.
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L2|L3"
export PYTHONPATH=$PWD
echo "--- default allocator"; python3 experiments/probes/cpu_adam.py
echo "--- THP_MEM_ALLOC_ENABLE=1"; THP_MEM_ALLOC_ENABLE=1 python3 experiments/probes/cpu_adam.py
