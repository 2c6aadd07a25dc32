"""Starting jobs: ``hvdtrain launch`` over horovodrun (horovodrun.py), Ray (ray.py, ray_plan.py,
ray_rendezvous.py), and where a rank's threads run (placement.py)."""
