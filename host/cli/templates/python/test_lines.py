from lines import line


def test_a_line_holds_the_step_and_the_numbers():
    values = [("loss", 0.5), ("tokens", 64), ("note", "skipped")]
    assert line(3, values) == '{"step":3,"loss":0.5,"tokens":64}'
