# CUDA sources compiled at run time by kuiper_py.ops_cupy (cupy.RawModule); shipped as package data.
