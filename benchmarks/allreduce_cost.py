"""Time and CPU of one 45 MB float32 allreduce (resnet18's gradients), per rank: PyTorch's Gloo
(what DDP uses) against Horovod's (Gloo or MPI controller). One rank's process CPU includes every
thread (Horovod's background thread, Gloo's I/O thread) and the kernel's share.

    torchrun --standalone --nproc_per_node 2 benchmarks/allreduce_cost.py torch
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/allreduce_cost.py horovod
    horovodrun -np 2 -H localhost:2 --mpi python benchmarks/allreduce_cost.py horovod

--megabytes 31,16 --average: resnet18's two 25 MB gradient groups averaged as hvdtrain does it
(one grouped allreduce with hvd.Average, fused in Horovod's buffer), against DDP's buckets (each
divided by the world size, then allreduced).
"""

import argparse
import resource
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", choices=["torch", "horovod"])
    parser.add_argument("--megabytes", default="45", help="a size, or sizes joined by commas: one group")
    parser.add_argument("--average", action="store_true", help="average instead of sum")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [float(size) for size in args.megabytes.split(",")]
    tensors = [torch.ones(int(size * 1e6 / 4)) for size in sizes]
    if args.library == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def allreduce():
            works = []
            for tensor in tensors:
                if args.average:
                    tensor.div_(dist.get_world_size())
                works.append(dist.all_reduce(tensor, async_op=True))
            for work in works:
                work.wait()
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
        op = hvd.Average if args.average else hvd.Sum

        def allreduce():
            if len(tensors) == 1:
                hvd.allreduce_(tensors[0], op=op, name="gradients")
            else:
                hvd.grouped_allreduce_(tensors, op=op, name="gradients")
    for _ in range(3):
        allreduce()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.calls):
        allreduce()
    seconds = (time.perf_counter() - start) / args.calls
    after = resource.getrusage(resource.RUSAGE_SELF)
    user = (after.ru_utime - before.ru_utime) / args.calls
    system = (after.ru_stime - before.ru_stime) / args.calls
    what = f"{'average' if args.average else 'sum'} of {args.megabytes} MB"
    # One write per line: print() writes the newline apart, and the other rank's line may land between.
    sys.stdout.write(f"{args.library} rank {rank}: {seconds * 1e3:.1f} ms per {what} "
                     f"({sum(sizes) / seconds:.0f} MB/s), process CPU {(user + system) * 1e3:.1f} ms per call "
                     f"({system * 1e3:.1f} ms in the kernel)\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
