import json
import os
import sys

sys.path.insert(0, '/work/main')
from pathlib import Path

from harness.tools.cgroup import MemoryCgroup, drop_page_cache

m = Path('models/tinymoe-f16.gguf')
for rep in range(3):
    for spec in ('stock', 'unset', 'mode=off', 'auto'):
        tree = 'llama.cpp' if spec == 'stock' else 'llama.cpp-patched'
        env = dict(os.environ); env.pop('LLAMA_MOE_CACHE', None)
        if spec not in ('stock', 'unset'): env['LLAMA_MOE_CACHE'] = spec
        drop_page_cache(m)
        with MemoryCgroup(48 << 20, prefix='moe-subst-offtest') as cg:
            rc, out, err = cg.run([f'vendor/{tree}/build-cpu/bin/llama-bench', '-m', str(m), '-p', '0', '-n', '64', '-r', '1', '-t', '2', '--repack', '0', '-o', 'jsonl', '-v'], env, 120)
        r = round(json.loads([l for l in out.splitlines() if l.startswith('{')][0])['avg_ts'], 1) if rc == 0 else rc
        print(rep, spec, r, flush=True)
