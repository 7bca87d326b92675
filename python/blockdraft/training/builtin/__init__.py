"""The built-in pair's factory: the corpus (:mod:`~blockdraft.training.builtin.corpus_site`,
:mod:`~blockdraft.training.builtin.licences`), the target and its tuning
(:mod:`~blockdraft.training.builtin.target`, :mod:`~blockdraft.training.builtin.unlikelihood`),
the presets, the model card, and the command that runs it all,
``python -m blockdraft.training.builtin.make_builtin_pair``."""
