"""BAGEL pieces both stages share: the model-folder reader, the FLUX autoencoder and the image transforms.

Plain torch only (no vLLM imports): the thinker stage's vLLM model and the generation runner both use them.
"""
