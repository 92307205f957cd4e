"""Run several rewritten scripts one after another in every rank of one torchrun job.

    torchrun --nproc-per-node N tests/apply/dist_jobs.py JOBS.json [gloo|nccl]

JOBS.json: [{"script": ..., "args": [...], "save": "params.pt"}, ...].  Starting torch and
a process group once for all of them keeps the multi-process tests within CI's time.
"""
import gc
import json
import sys

import torch.distributed as dist

from memadvisor.apply import launch, runtime


def main(job_file, backend="gloo"):
    jobs = json.load(open(job_file))
    dist.init_process_group(backend)
    for job in jobs:
        launch.run_script(job["script"], job["args"])
        runtime.finish(save_parameters=job["save"], destroy_process_group=False)
        dist.barrier()
    # DDP objects still alive when the group goes away can abort the process at exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
