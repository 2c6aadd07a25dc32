#!/usr/bin/env python3
"""Turn a cloud's instance list into an hvdtrain hostfile (horovodrun's "host slots=N" lines).

    aws ec2 describe-instances --filters Name=tag:job,Values=hvdtrain --output json > instances.json
    python hostfiles/cloud_hosts.py aws instances.json > hostfile        # slots from the instance type
    az vm list-ip-addresses --resource-group hvdtrain-rg --output json > ips.json
    python hostfiles/cloud_hosts.py azure ips.json --slots 4 > hostfile   # this listing has no VM size
    horovodrun -np 8 --hostfile hostfile python -P -m hvdtrain --config imagenet_resnet50 ...

Only running AWS instances are listed; private addresses by default (the ranks talk over the VPC /
VNet; --address public for machines reached from outside). ``--format hosts`` prints the -H form
(a:4,b:4) instead, ``--format openmpi`` adds max_slots for mpirun. Stdlib only: it runs anywhere
the cloud CLI runs. See docs/cloud.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# GPUs per AWS instance type (the types docs/cloud.md uses; others: --slots N).
AWS_GPUS = {
    "g4dn.xlarge": 1, "g4dn.2xlarge": 1, "g4dn.4xlarge": 1, "g4dn.8xlarge": 1, "g4dn.16xlarge": 1,
    "g4dn.12xlarge": 4, "g4dn.metal": 8,
    "g5.xlarge": 1, "g5.2xlarge": 1, "g5.4xlarge": 1, "g5.8xlarge": 1, "g5.16xlarge": 1,
    "g5.12xlarge": 4, "g5.24xlarge": 4, "g5.48xlarge": 8,
    "g6.xlarge": 1, "g6.12xlarge": 4, "g6.48xlarge": 8,
    "p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8,
    "p4d.24xlarge": 8, "p4de.24xlarge": 8, "p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8,
}


class HostListError(ValueError):
    """The input is not the listing it should be, or a host's slots are unknown (one line)."""


def aws_hosts(listing: dict, slots: int | None, address: str) -> list[tuple[str, int]]:
    """(address, slots) of the running instances in `aws ec2 describe-instances` JSON."""
    if not isinstance(listing, dict) or "Reservations" not in listing:
        raise HostListError("not `aws ec2 describe-instances` JSON (no top-level 'Reservations')")
    key = "PrivateIpAddress" if address == "private" else "PublicIpAddress"
    hosts = []
    for reservation in listing["Reservations"]:
        for instance in reservation.get("Instances", []):
            if instance.get("State", {}).get("Name") != "running":
                continue
            name = instance.get("InstanceId", "?")
            ip = instance.get(key)
            if not ip:
                raise HostListError(f"instance {name} has no {key} (try --address "
                                    f"{'public' if address == 'private' else 'private'})")
            count = slots or AWS_GPUS.get(instance.get("InstanceType", ""))
            if not count:
                raise HostListError(f"instance {name}: GPUs of instance type '{instance.get('InstanceType')}' "
                                    f"unknown; pass --slots N")
            hosts.append((ip, count))
    return hosts


def azure_hosts(listing: list, slots: int | None, address: str) -> list[tuple[str, int]]:
    """(address, slots) of the VMs in `az vm list-ip-addresses` JSON (it names no VM size: --slots)."""
    if not isinstance(listing, list) or any("virtualMachine" not in entry for entry in listing):
        raise HostListError("not `az vm list-ip-addresses` JSON (a list of {'virtualMachine': ...})")
    if not slots:
        raise HostListError("`az vm list-ip-addresses` does not say how many GPUs a VM has: pass --slots N")
    hosts = []
    for entry in listing:
        vm = entry["virtualMachine"]
        network = vm.get("network", {})
        if address == "private":
            ips = network.get("privateIpAddresses") or []
        else:
            ips = [p.get("ipAddress") for p in network.get("publicIpAddresses") or [] if p.get("ipAddress")]
        if not ips:
            raise HostListError(f"VM {vm.get('name', '?')} has no {address} IP address (try --address "
                                f"{'public' if address == 'private' else 'private'})")
        hosts.append((ips[0], slots))
    return hosts


def render(hosts: list[tuple[str, int]], fmt: str, source: str) -> str:
    if fmt == "hosts":
        return ",".join(f"{host}:{slots}" for host, slots in hosts) + "\n"
    if fmt == "openmpi":  # Open MPI's hostfile takes comments; horovodrun's parser does not
        lines = [f"# {len(hosts)} hosts, {sum(s for _, s in hosts)} slots, from {source}"]
        return "\n".join(lines + [f"{host} slots={slots} max_slots={slots}" for host, slots in hosts]) + "\n"
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cloud", choices=["aws", "azure"])
    parser.add_argument("listing", help="the CLI's JSON output (a file, or - for stdin)")
    parser.add_argument("--slots", type=int, default=None, help="ranks per host (default: GPUs of the AWS type)")
    parser.add_argument("--address", choices=["private", "public"], default="private")
    parser.add_argument("--format", choices=["horovodrun", "openmpi", "hosts"], default="horovodrun")
    args = parser.parse_args(argv)
    try:
        if args.slots is not None and args.slots <= 0:
            raise HostListError(f"--slots must be positive, got {args.slots}")
        text = sys.stdin.read() if args.listing == "-" else Path(args.listing).read_text()
        try:
            listing = json.loads(text)
        except ValueError as error:
            raise HostListError(f"{args.listing} is not JSON ({error}); run the CLI with --output json") from None
        hosts = (aws_hosts if args.cloud == "aws" else azure_hosts)(listing, args.slots, args.address)
        if not hosts:
            raise HostListError(f"no running hosts in {args.listing}")
    except (HostListError, OSError) as error:
        print(f"cloud_hosts: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(hosts, args.format, f"{args.cloud} {Path(args.listing).name}"))
    print(f"cloud_hosts: {len(hosts)} hosts, {sum(s for _, s in hosts)} slots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
