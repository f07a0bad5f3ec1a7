"""What builds, checks and shows the package but is no part of it (the wheel leaves it out): the bundled
demo model's build (`build_demo`, `pretrain_encoder`, `demo_examples`, `judge`), the held-out scene
generator (`heldout`), the notebooks' helpers (`lab`) and the runs both the build and the notebooks make
(`scene_runs`). Run from the repo root, as `python -m tools.build_demo`; tools import `captioner`, never
the other way round."""
