//! A tracker built against a future major of the WIT package
//! (hearth:plugin@1.0.0): it must be refused at load.
wit_bindgen::generate!({
    inline: "
        package hearth:plugin@1.0.0;
        interface tracker {
            start: func(run: string) -> result<_, string>;
            log: func(step: u64, values: list<tuple<string, f64>>) -> result<_, string>;
            finish: func() -> result<_, string>;
        }
        world tracker-plugin { export tracker; }
    ",
});

struct Future;

impl exports::hearth::plugin::tracker::Guest for Future {
    fn start(_run: String) -> Result<(), String> {
        Ok(())
    }
    fn log(_step: u64, _values: Vec<(String, f64)>) -> Result<(), String> {
        Ok(())
    }
    fn finish() -> Result<(), String> {
        Ok(())
    }
}

export!(Future);
