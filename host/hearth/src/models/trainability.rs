//! Which parameters train: each keeps the `requires_grad` it was saved
//! with (a TorchScript file's, a `VarStore`'s), and `[model] trainable` /
//! `frozen` globs over the parameter names override it, `frozen` winning
//! where both match.

use tch::Tensor;

/// Why the trainability globs cannot be applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TrainabilityError {
    /// A glob that does not parse.
    #[error("`model.{key}` glob `{glob}` is not a glob: {message}")]
    BadGlob {
        /// `trainable` or `frozen`.
        key: &'static str,
        /// The glob.
        glob: String,
        /// The parser's reason.
        message: String,
    },
    /// A glob that matches no parameter (a typo, or another prefix).
    #[error(
        "`model.{key}` glob `{glob}` matches no parameter; the names are listed by `hearth model plan` (for example `{example}`)"
    )]
    NoMatch {
        /// `trainable` or `frozen`.
        key: &'static str,
        /// The glob.
        glob: String,
        /// A parameter's name, to show the convention.
        example: String,
    },
    /// Nothing would train.
    #[error(
        "no parameter trains: all {count} require no gradient{why}; name what should train with `[model] trainable = [\"glob\", …]`"
    )]
    NothingTrains {
        /// How many parameters the model has.
        count: usize,
        /// Where the frozen flags came from.
        why: String,
    },
}

/// How many parameters train and how many are frozen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trainable {
    /// Elements of the parameters that train.
    pub trainable: i64,
    /// Elements of the frozen ones.
    pub frozen: i64,
}

impl Trainable {
    /// The counts of `params` as their flags are now.
    pub fn of(params: &[(String, Tensor)]) -> Self {
        let mut counts = Self::default();
        for (_, p) in params {
            match p.requires_grad() {
                true => counts.trainable += p.numel() as i64,
                false => counts.frozen += p.numel() as i64,
            }
        }
        counts
    }
}

impl std::fmt::Display for Trainable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total = (self.trainable + self.frozen).max(1);
        write!(
            f,
            "{} trainable ({:.2}%), {} frozen",
            self.trainable,
            100.0 * self.trainable as f64 / total as f64,
            self.frozen
        )
    }
}

/// Sets each of `params`' `requires_grad`: `trainable` globs turn it on,
/// then `frozen` globs off; the others keep theirs. Every glob must match
/// some name, and some parameter must train.
pub fn apply(
    params: &[(String, Tensor)],
    trainable: &[String],
    frozen: &[String],
) -> Result<Trainable, TrainabilityError> {
    let example = params.first().map(|(n, _)| n.clone()).unwrap_or_default();
    let compile = |key: &'static str, globs: &[String]| {
        globs
            .iter()
            .map(|g| {
                let pattern = glob::Pattern::new(g).map_err(|e| TrainabilityError::BadGlob {
                    key,
                    glob: g.clone(),
                    message: e.msg.to_string(),
                })?;
                if !params.iter().any(|(n, _)| pattern.matches(n)) {
                    return Err(TrainabilityError::NoMatch {
                        key,
                        glob: g.clone(),
                        example: example.clone(),
                    });
                }
                Ok(pattern)
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let (on, off) = (compile("trainable", trainable)?, compile("frozen", frozen)?);
    for (name, p) in params {
        let set = if off.iter().any(|g| g.matches(name)) {
            Some(false)
        } else if on.iter().any(|g| g.matches(name)) {
            Some(true)
        } else {
            None
        };
        if let Some(flag) = set {
            if p.requires_grad() != flag {
                let _ = p.set_requires_grad(flag);
            }
        }
    }
    let counts = Trainable::of(params);
    if counts.trainable == 0 && !params.is_empty() {
        let why = match (trainable.is_empty(), frozen.is_empty()) {
            (true, true) => " as the model was saved".to_string(),
            _ => " after `model.trainable` and `model.frozen`".to_string(),
        };
        return Err(TrainabilityError::NothingTrains {
            count: params.len(),
            why,
        });
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn params(names: &[&str]) -> Vec<(String, Tensor)> {
        names
            .iter()
            .map(|n| {
                let t = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                (n.to_string(), t)
            })
            .collect()
    }

    fn flags(params: &[(String, Tensor)]) -> Vec<bool> {
        params.iter().map(|(_, p)| p.requires_grad()).collect()
    }

    #[test]
    fn frozen_wins_over_trainable_and_the_rest_keep_their_flags() {
        let p = params(&[
            "m.embed.weight",
            "m.layers.0.q.weight",
            "m.layers.0.q.lora_A.weight",
        ]);
        let _ = p[1].1.set_requires_grad(false);
        let counts = apply(
            &p,
            &["*.lora_*".into(), "m.embed.*".into()],
            &["m.embed.*".into()],
        )
        .unwrap();
        assert_eq!(flags(&p), [false, false, true]);
        assert_eq!(
            counts,
            Trainable {
                trainable: 6,
                frozen: 12
            }
        );
        assert_eq!(counts.to_string(), "6 trainable (33.33%), 12 frozen");
    }

    #[test]
    fn a_glob_matching_nothing_is_named() {
        let p = params(&["m.embed.weight"]);
        let err = apply(&p, &[], &["embed.*".into()]).unwrap_err();
        assert_eq!(
            err,
            TrainabilityError::NoMatch {
                key: "frozen",
                glob: "embed.*".into(),
                example: "m.embed.weight".into()
            }
        );
    }

    #[test]
    fn a_model_with_nothing_to_train_is_refused() {
        let p = params(&["a", "b"]);
        let err = apply(&p, &[], &["*".into()]).unwrap_err();
        assert!(matches!(
            err,
            TrainabilityError::NothingTrains { count: 2, .. }
        ));
    }
}
