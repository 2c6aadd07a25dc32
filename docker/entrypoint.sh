#!/bin/bash
# Container entry point: install the shared ssh keys, start sshd on $HVDTRAIN_SSH_PORT, run the
# command (default: bash). Worker containers run `sleep infinity` and wait for ranks over ssh.
#
# Keys: mount a directory with id_ed25519, id_ed25519.pub and authorized_keys (the same on every
# container) at /keys, or set HVDTRAIN_SSH_KEYS to where it is mounted. Without keys, sshd still
# starts but nobody can log in (there are no passwords).
set -euo pipefail

keys=${HVDTRAIN_SSH_KEYS:-/keys}
port=${HVDTRAIN_SSH_PORT:-12345}
mkdir -p /root/.ssh /run/sshd
chmod 700 /root/.ssh
if [[ -d $keys ]]; then
    for name in id_ed25519 id_ed25519.pub authorized_keys known_hosts; do
        [[ -f $keys/$name ]] && install -m 600 "$keys/$name" "/root/.ssh/$name"
    done
fi
# Outgoing ssh (horovodrun, mpirun) reaches the other containers on the same port. Host keys are
# generated per container, so they are accepted on first use unless known_hosts was provided.
if [[ ! -f /root/.ssh/config ]]; then
    printf 'Host *\n    Port %s\n    StrictHostKeyChecking accept-new\n    BatchMode yes\n' "$port" >/root/.ssh/config
    chmod 600 /root/.ssh/config
fi
ssh-keygen -A >/dev/null
# ssh sessions do not see the image's ENV: give them the venv's PATH and CUDA's libraries
# (sshd_config permits exactly these two in ~/.ssh/environment).
{ echo "PATH=$PATH"; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; } >/root/.ssh/environment
/usr/sbin/sshd -f /etc/ssh/hvdtrain_sshd_config -o "Port=$port"
exec "$@"
