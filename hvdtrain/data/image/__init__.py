"""Images: decoding and crops (decode.py, device_decode.py), transforms, augmentation
policies and the resolution schedule (policies.py), mixing, and the folder dataset."""
