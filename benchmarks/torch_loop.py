"""The reference contenders: a minimal hand-written PyTorch training loop.

One process (``python benchmarks/torch_loop.py``): the raw loop hvdtrain must not be slower than.
Under ``torchrun --nproc_per_node N`` it wraps the model in DistributedDataParallel (Gloo on CPU,
NCCL on GPU): the PyTorch-native contender. Same model, synthetic batch, SGD with momentum and
weight decay as hvdtrain; warm-up steps excluded; prints ``images_per_sec=<total>`` like
``hvdtrain bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torchvision import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--amp", action="store_true", help="float16 autocast + GradScaler (CUDA)")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--json", help="write the result here (rank 0)")
    parser.add_argument("--fp16-hook", action="store_true",
                        help="under torchrun: DDP with torch's fp16_compress_hook (gradients sent as float16)")
    parser.add_argument("--horovod", action="store_true",
                        help="under horovodrun: hvd.DistributedOptimizer instead of DDP (Horovod without hvdtrain)")
    args = parser.parse_args()

    distributed = "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    hvd = None
    if args.horovod:
        import horovod.torch as hvd
        hvd.init()
        distributed = False
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    torch.set_num_threads(args.threads)
    rank, world = (hvd.rank(), hvd.size()) if hvd else (0, 1)
    if distributed:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    torch.manual_seed(0)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = models.get_model(args.arch, weights=None, num_classes=1000).to(device, memory_format=memory_format)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        if args.fp16_hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            model.register_comm_hook(None, fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    if hvd:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler(device.type) if args.amp else None
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
            loss = F.cross_entropy(model(images), labels)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        if distributed:
            torch.distributed.barrier()
        if hvd:
            hvd.allreduce(torch.zeros(1), name="sync")

    for _ in range(args.warmup_steps):
        step()
    sync()
    start = time.perf_counter()
    timed_steps = 0  # counted, so that a caller can check the work it timed was done
    for _ in range(args.steps):
        step()
        timed_steps += 1
    sync()
    seconds = time.perf_counter() - start
    total = args.steps * args.batch_size * world / seconds
    if rank == 0:
        print(f"torch_loop: {args.arch} {args.image_size}px, batch {args.batch_size}/rank x {world} ranks "
              f"({'DDP' if distributed else 'Horovod' if hvd else 'one process'}"
              f"{', fp16_compress_hook' if distributed and args.fp16_hook else ''}), {device.type}, "
              f"{args.threads} threads/rank")
        print(f"images_per_sec={total:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"images_per_sec": total, "world_size": world, "seconds": seconds, "steps": timed_steps,
                           "samples": timed_steps * args.batch_size * world,
                           "fp16_hook": distributed and args.fp16_hook}, handle)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
