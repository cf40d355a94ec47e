"""map_location as a callable, as torch.load takes it (issue 37 item 6): it used to raise."""

import torch

import flashwrite as fw


def test_callable_map_location_loads_to_where_it_says(tmp_path):
    sd = {f"w{i}": torch.randn(100, 7) for i in range(6)} | {"b": torch.arange(9, dtype=torch.int16)}
    fw.save(sd, tmp_path / "ck")
    asked = []

    def keep_on_cpu(storage, location):
        asked.append(location)
        return storage

    back = fw.load(tmp_path / "ck", map_location=keep_on_cpu)
    assert all(torch.equal(back[k], sd[k]) and back[k].device.type == "cpu" for k in sd)
    assert set(asked) == {"cpu"} and len(asked) <= 2  # per saved device (plan, then placing), not per tensor
    back = fw.load(tmp_path / "ck", map_location=lambda storage, location: None)  # None: where it was saved
    assert all(torch.equal(back[k], sd[k]) for k in sd)
