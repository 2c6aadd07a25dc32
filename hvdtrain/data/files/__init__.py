"""File lists of image folders: the index and its cache (index.py), the shared compact list
(file_list.py), the validation split carved from train/, and the files that fail."""
