"""Starting jobs: ``hvdtrain launch`` over horovodrun (horovodrun.py; the ranks'
exit records, records.py; stop signals forwarded, forwarding.py), Ray (ray.py, ray_plan.py,
ray_rendezvous.py), a Slurm batch script of one's own (slurm_script.py), the scheduler's job a
process runs in (job.py), and where a rank's threads run (placement.py)."""
