"""Where samples come from: sources read by position (:mod:`.source`), which source a spec
names (:mod:`.open`), and the per-worker loader that reads ahead (:mod:`.loader`)."""
