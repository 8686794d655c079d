"""The library of tools/make_checkpoint.py (the command), one module per part, in
dependency order:

* ``formats``  the checkpoint formats: block sizes, element formats, the UE8M0 / fp8-block /
               MXFP4 encoders and decoders (benchmarks/e2e/reference.py reads checkpoints
               with these decoders)
* ``config``   a config.json loaded, its model kind resolved and its topology checked
* ``tensors``  the tensor table: every checkpoint tensor's name, shape, dtype, kind and
               initialization, as the published checkpoints name them
* ``spec``     the speculative draft's config keys and tensors (V4 MTP, V4.1 / V4
               DSpark), after the target's

Drawing the values, quantizing per format and writing the shards stay in the command.
This file imports none of them. Their modules need tools/ on ``sys.path`` (for _common).
"""
