"""Ratings for the recommendation task: MovieLens files (movielens.py) and batches (batches.py)."""
