"""The evaluation stage: how good a trained model's captions are.

``evaluate`` (the command's work: caption a split, score it, keep the result under its key), ``metrics``
(pycocoevalcap's scorers, called directly), ``grounding`` (on the synthetic data: which shapes the
captions name, and where the attention looked).
"""
