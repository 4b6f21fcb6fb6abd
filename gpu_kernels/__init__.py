"""The fast paths: Triton (and Gluon) kernels, each file naming the plain-PyTorch reference it equals.

This package is the leaf of the project: it imports torch and triton only, never a concept module.
A concept module (nvfp4.py, moe.py, rac.py, rollout.py) chooses, in one visible place, whether to call
a kernel here or its own reference. (Not named `kernels`: that is a Hugging Face package, which
transformers imports when it is installed, and a folder of that name would shadow it.)
"""
