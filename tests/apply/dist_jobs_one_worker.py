"""``dist_jobs.py`` with the process group made as the apply runtime makes it on CPU: gloo
with one worker thread per group (``gloo_release``), so FSDP and tp plans drain it.

    torchrun --nproc-per-node N tests/apply/dist_jobs_one_worker.py JOBS.json
"""
import sys

import dist_jobs

from memadvisor.apply import gloo_release

if __name__ == "__main__":
    gloo_release.create_groups_with_one_worker()
    dist_jobs.main(*sys.argv[1:])
    print(f"drained {gloo_release.drains} times", flush=True)
