//! The built-in learning-rate schedules, one component installed under a
//! plugin name per schedule (`manifests/*.toml`; each sets the `schedule`
//! option). Values follow transformers' `get_*_schedule*` functions and
//! PyTorch's `StepLR`, `OneCycleLR` and `ReduceLROnPlateau` step for step:
//! the rate at optimizer step `k` (0-based) is what those schedulers give
//! after `k` calls of `scheduler.step()`.

mod options;
mod plateau;

use hearth_guest::{export_scheduler, Scheduler};
use options::Options;
use plateau::Plateau;
use std::f64::consts::PI;

/// A schedule that is a factor of the base rates at each step (LambdaLR).
enum Factor {
    Constant,
    ConstantWithWarmup {
        warmup: u64,
    },
    Linear {
        warmup: u64,
        total: u64,
    },
    Cosine {
        warmup: u64,
        total: u64,
        cycles: f64,
        min_rate: f64,
    },
    CosineRestarts {
        warmup: u64,
        total: u64,
        cycles: f64,
    },
    Polynomial {
        warmup: u64,
        total: u64,
        lr_end: f64,
        power: f64,
        lr_init: f64,
    },
    InverseSqrt {
        warmup: u64,
        timescale: u64,
    },
    Step {
        size: u64,
        gamma: f64,
    },
}

fn warmup(step: u64, warmup: u64) -> f64 {
    step as f64 / warmup.max(1) as f64
}

impl Factor {
    fn at(&self, step: u64) -> f64 {
        match *self {
            Factor::Constant => 1.0,
            Factor::ConstantWithWarmup { warmup: w } if step < w => warmup(step, w),
            Factor::ConstantWithWarmup { .. } => 1.0,
            Factor::Linear { warmup: w, .. }
            | Factor::Cosine { warmup: w, .. }
            | Factor::CosineRestarts { warmup: w, .. }
            | Factor::Polynomial { warmup: w, .. }
            | Factor::InverseSqrt { warmup: w, .. }
                if step < w =>
            {
                warmup(step, w)
            }
            Factor::Linear { warmup, total } => (total.saturating_sub(step) as f64
                / total.saturating_sub(warmup).max(1) as f64)
                .max(0.0),
            Factor::Cosine {
                warmup,
                total,
                cycles,
                min_rate,
            } => {
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                let f = 0.5 * (1.0 + (PI * cycles * 2.0 * progress).cos());
                (f * (1.0 - min_rate) + min_rate).max(0.0)
            }
            Factor::CosineRestarts {
                warmup,
                total,
                cycles,
            } => {
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                if progress >= 1.0 {
                    return 0.0;
                }
                (0.5 * (1.0 + (PI * ((cycles * progress) % 1.0)).cos())).max(0.0)
            }
            Factor::Polynomial {
                warmup,
                total,
                lr_end,
                power,
                lr_init,
            } => {
                if step > total {
                    return lr_end / lr_init;
                }
                let remaining = 1.0 - (step - warmup) as f64 / (total - warmup) as f64;
                ((lr_init - lr_end) * remaining.powf(power) + lr_end) / lr_init
            }
            Factor::InverseSqrt { warmup, timescale } => {
                let shift = timescale as f64 - warmup as f64;
                1.0 / ((step as f64 + shift) / timescale as f64).sqrt()
            }
            Factor::Step { size, gamma } => {
                gamma.powi(i32::try_from(step / size).unwrap_or(i32::MAX))
            }
        }
    }
}

/// PyTorch's `OneCycleLR` (two or three phases), without momentum cycling.
struct OneCycle {
    /// Per group: (initial, max, min) rates.
    rates: Vec<(f64, f64, f64)>,
    /// (end step, from, to) per phase; from/to index into (initial, max, min).
    phases: Vec<(f64, usize, usize)>,
    cosine: bool,
    total: u64,
}

impl OneCycle {
    fn new(o: &mut Options, base: &[f64], total: Option<u64>) -> Result<Self, String> {
        let total = o
            .count("total-steps")?
            .or(total)
            .ok_or("needs `total-steps` (the run's steps are not known)")?;
        if total == 0 {
            return Err("`one-cycle` needs at least 1 step".into());
        }
        let max = o
            .numbers("max-lr", base.len())?
            .unwrap_or_else(|| base.to_vec());
        let pct = o.number("pct-start")?.unwrap_or(0.3);
        if !(0.0..=1.0).contains(&pct) {
            return Err(format!("`pct-start` must be in [0, 1], not {pct}"));
        }
        let div = o.number("div-factor")?.unwrap_or(25.0);
        let final_div = o.number("final-div-factor")?.unwrap_or(1e4);
        let cosine = match o.string("anneal-strategy")?.as_deref() {
            None | Some("cos") => true,
            Some("linear") => false,
            Some(other) => {
                return Err(format!(
                    "`anneal-strategy` must be \"cos\" or \"linear\", not \"{other}\""
                ))
            }
        };
        let (initial, peak, min) = (0, 1, 2);
        let t = total as f64;
        let phases = if o.flag("three-phase")?.unwrap_or(false) {
            vec![
                (pct * t - 1.0, initial, peak),
                (2.0 * pct * t - 2.0, peak, initial),
                (t - 1.0, initial, min),
            ]
        } else {
            vec![(pct * t - 1.0, initial, peak), (t - 1.0, peak, min)]
        };
        let rates = max
            .iter()
            .map(|m| (m / div, *m, m / div / final_div))
            .collect();
        Ok(Self {
            rates,
            phases,
            cosine,
            total,
        })
    }

    fn lrs(&self, step: u64) -> Vec<f64> {
        let n = step.min(self.total) as f64;
        self.rates
            .iter()
            .map(|&(initial, peak, min)| {
                let value = [initial, peak, min];
                let mut start = 0.0;
                for (i, &(end, from, to)) in self.phases.iter().enumerate() {
                    if n <= end || i == self.phases.len() - 1 {
                        let pct = (n - start) / (end - start);
                        let (a, b) = (value[from], value[to]);
                        return if self.cosine {
                            b + (a - b) / 2.0 * ((PI * pct).cos() + 1.0)
                        } else {
                            (b - a) * pct + a
                        };
                    }
                    start = end;
                }
                unreachable!("the last phase always matches")
            })
            .collect()
    }
}

enum Schedules {
    Factor { base: Vec<f64>, factor: Factor },
    OneCycle(OneCycle),
    Plateau(Plateau),
}

const WARMUP: &str = "warmup-steps";

fn create(
    name: &str,
    o: &mut Options,
    base: Vec<f64>,
    total: Option<u64>,
) -> Result<(Schedules, &'static [&'static str]), String> {
    let needs_total = || total.ok_or(format!("`{name}` needs the total number of steps"));
    let lr_init = base
        .first()
        .copied()
        .ok_or("the optimizer has no parameter groups")?;
    let (factor, known): (Factor, &'static [&'static str]) = match name {
        "constant" => (Factor::Constant, &[]),
        "constant-with-warmup" => (
            Factor::ConstantWithWarmup {
                warmup: o.count(WARMUP)?.unwrap_or(0),
            },
            &[WARMUP],
        ),
        "linear" => (
            Factor::Linear {
                warmup: o.count(WARMUP)?.unwrap_or(0),
                total: needs_total()?,
            },
            &[WARMUP],
        ),
        "cosine" => {
            let (warmup, total) = (o.count(WARMUP)?.unwrap_or(0), needs_total()?);
            let known: &'static [&'static str] =
                &[WARMUP, "cycles", "min-lr", "min-lr-rate", "restarts"];
            if o.flag("restarts")?.unwrap_or(false) {
                let cycles = o.count("cycles")?.unwrap_or(1) as f64;
                (
                    Factor::CosineRestarts {
                        warmup,
                        total,
                        cycles,
                    },
                    known,
                )
            } else {
                let cycles = o.number("cycles")?.unwrap_or(0.5);
                let min_rate = match (o.number("min-lr")?, o.number("min-lr-rate")?) {
                    (Some(_), Some(_)) => {
                        return Err("set one of `min-lr` and `min-lr-rate`, not both".into())
                    }
                    (Some(min), None) => min / lr_init,
                    (None, rate) => rate.unwrap_or(0.0),
                };
                (
                    Factor::Cosine {
                        warmup,
                        total,
                        cycles,
                        min_rate,
                    },
                    known,
                )
            }
        }
        "polynomial" => {
            let (warmup, total) = (o.count(WARMUP)?.unwrap_or(0), needs_total()?);
            let lr_end = o.number("lr-end")?.unwrap_or(1e-7);
            if lr_init <= lr_end {
                return Err(format!(
                    "`lr-end` ({lr_end}) must be smaller than the initial rate ({lr_init})"
                ));
            }
            if warmup >= total {
                return Err(format!(
                    "`{WARMUP}` ({warmup}) must be less than the {total} steps of the run"
                ));
            }
            let power = o.number("power")?.unwrap_or(1.0);
            if power <= 0.0 {
                return Err(format!("`power` must be > 0, not {power}"));
            }
            (
                Factor::Polynomial {
                    warmup,
                    total,
                    lr_end,
                    power,
                    lr_init,
                },
                &[WARMUP, "lr-end", "power"],
            )
        }
        "inverse-sqrt" => {
            let warmup = o.count(WARMUP)?.unwrap_or(0);
            let timescale =
                o.count("timescale")?
                    .unwrap_or(if warmup > 0 { warmup } else { 10_000 });
            if timescale == 0 {
                return Err("`timescale` must be at least 1".into());
            }
            (
                Factor::InverseSqrt { warmup, timescale },
                &[WARMUP, "timescale"],
            )
        }
        "step" => {
            let size = o.count("step-size")?.ok_or("`step` needs `step-size`")?;
            if size == 0 {
                return Err("`step-size` must be at least 1".into());
            }
            (
                Factor::Step {
                    size,
                    gamma: o.number("gamma")?.unwrap_or(0.1),
                },
                &["step-size", "gamma"],
            )
        }
        "one-cycle" => {
            let known = &[
                "total-steps",
                "max-lr",
                "pct-start",
                "div-factor",
                "final-div-factor",
                "anneal-strategy",
                "three-phase",
            ];
            return Ok((Schedules::OneCycle(OneCycle::new(o, &base, total)?), known));
        }
        "reduce-on-plateau" => {
            return Ok((
                Schedules::Plateau(Plateau::new(o, &base)?),
                plateau::OPTIONS,
            ))
        }
        other => return Err(format!("unknown schedule `{other}`")),
    };
    if let Factor::Linear { warmup, total } | Factor::Cosine { warmup, total, .. } = &factor {
        if warmup > total {
            return Err(format!(
                "`{WARMUP}` ({warmup}) is more than the {total} steps of the run"
            ));
        }
    }
    Ok((Schedules::Factor { base, factor }, known))
}

impl Scheduler for Schedules {
    fn create(
        options_json: &str,
        base_lrs: Vec<f64>,
        total_steps: Option<u64>,
    ) -> Result<Self, String> {
        let mut o = Options::parse(options_json)?;
        let name = o
            .string("schedule")?
            .ok_or("no `schedule` option (the plugin's manifest sets it)")?;
        let (schedule, known) = create(&name, &mut o, base_lrs, total_steps)?;
        o.finish(&name, known)?;
        Ok(schedule)
    }

    fn lrs(&self, step: u64) -> Vec<f64> {
        match self {
            Schedules::Factor { base, factor } => {
                let f = factor.at(step);
                base.iter().map(|lr| lr * f).collect()
            }
            Schedules::OneCycle(c) => c.lrs(step),
            Schedules::Plateau(p) => p.lrs(),
        }
    }

    fn observe(&mut self, metric: f64) {
        if let Schedules::Plateau(p) = self {
            p.observe(metric)
        }
    }

    fn save(&self) -> Vec<u8> {
        match self {
            Schedules::Plateau(p) => p.save(),
            // The others are functions of the step: nothing to save.
            _ => Vec::new(),
        }
    }

    fn load(&mut self, state: &[u8]) -> Result<(), String> {
        match self {
            Schedules::Plateau(p) => p.load(state),
            _ if state.is_empty() => Ok(()),
            _ => Err("this schedule keeps no state, but a non-empty one was given".into()),
        }
    }
}

export_scheduler!(Schedules);
