"""Time and CPU of one 45 MB float32 allreduce (resnet18's gradients), per rank: PyTorch's Gloo
(what DDP uses) against Horovod's (Gloo or MPI controller). One rank's process CPU includes every
thread (Horovod's background thread, Gloo's I/O thread) and the kernel's share.

    torchrun --standalone --nproc_per_node 2 benchmarks/allreduce_cost.py torch
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/allreduce_cost.py horovod
    horovodrun -np 2 -H localhost:2 --mpi python benchmarks/allreduce_cost.py horovod
"""

import argparse
import resource
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", choices=["torch", "horovod"])
    parser.add_argument("--megabytes", type=float, default=45.0)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensor = torch.ones(int(args.megabytes * 1e6 / 4))
    if args.library == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def allreduce():
            dist.all_reduce(tensor)
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()

        def allreduce():
            hvd.allreduce_(tensor, op=hvd.Sum, name="gradients")
    for _ in range(3):
        allreduce()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.calls):
        allreduce()
    seconds = (time.perf_counter() - start) / args.calls
    after = resource.getrusage(resource.RUSAGE_SELF)
    user = (after.ru_utime - before.ru_utime) / args.calls
    system = (after.ru_stime - before.ru_stime) / args.calls
    print(f"{args.library} rank {rank}: {seconds * 1e3:.1f} ms per {args.megabytes:g} MB allreduce "
          f"({args.megabytes / seconds:.0f} MB/s), process CPU {(user + system) * 1e3:.1f} ms per call "
          f"({system * 1e3:.1f} ms in the kernel)", flush=True)


if __name__ == "__main__":
    main()
