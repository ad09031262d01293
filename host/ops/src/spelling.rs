//! Accelerate's spellings of its enums (`"MULTI_CPU"`, `"bf16"`,
//! `"SHARDED_STATE_DICT"`, ...): [`spelled_enum!`](crate::spelled_enum)
//! gives an enum its spellings, parsed in any case, with a distinct error
//! for a value Accelerate has and hearth does not.

/// Gives a field-less enum Accelerate's spellings: `ALL` (every value, in
/// the order listed), `as_str` (the spelling), `Display`, `FromStr` (any
/// case, surrounding spaces ignored; other spellings in brackets, such as
/// Accelerate's numbers) and `TryFrom<String>` (for serde's `try_from`).
/// A value listed under `refused` (Accelerate's, for what hearth does not
/// have) is refused with its own message; anything else with "`value` is
/// not a WHAT; use ..." naming every spelling.
///
/// ```
/// #[derive(Debug, Clone, Copy, PartialEq)]
/// enum Prefetch { Pre, Post }
/// hearth_ops::spelled_enum! {
///     Prefetch: "prefetch mode" {
///         Pre = "BACKWARD_PRE" ("1"),
///         Post = "BACKWARD_POST" ("2"),
///     }
///     refused |s| { "BACKWARD_SIDEWAYS" => format!("{s} is not for hearth") }
/// }
/// assert_eq!("backward_pre".parse(), Ok(Prefetch::Pre));
/// assert_eq!(" 2 ".parse(), Ok(Prefetch::Post));
/// assert_eq!(Prefetch::Post.to_string(), "BACKWARD_POST");
/// assert_eq!("backward_sideways".parse::<Prefetch>(), Err("backward_sideways is not for hearth".into()));
/// assert_eq!(
///     "x".parse::<Prefetch>(),
///     Err("`x` is not a prefetch mode; use BACKWARD_PRE (1) or BACKWARD_POST (2)".into())
/// );
/// ```
#[macro_export]
macro_rules! spelled_enum {
    (
        $ty:ident : $what:literal {
            $($variant:ident = $spelling:literal $(($($alias:literal),+))?),+ $(,)?
        }
        $(refused |$s:ident| { $($($other:literal)|+ => $why:expr),+ $(,)? })?
    ) => {
        impl $ty {
            /// Every value, in the order of its spellings.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// Accelerate's spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $spelling),+
                }
            }

            fn spellings(self) -> &'static [&'static str] {
                match self {
                    $($ty::$variant => &[$spelling $($(, $alias)+)?]),+
                }
            }
        }

        impl ::core::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::core::str::FromStr for $ty {
            type Err = String;
            fn from_str(value: &str) -> Result<Self, String> {
                let value = value.trim();
                let spelled = |names: &[&str]| names.iter().any(|n| n.eq_ignore_ascii_case(value));
                if let Some(&found) = Self::ALL.iter().find(|v| spelled(v.spellings())) {
                    return Ok(found);
                }
                $(
                    let $s = value;
                    $(
                        if spelled(&[$($other),+]) {
                            return Err($why);
                        }
                    )+
                )?
                let choices: Vec<String> =
                    Self::ALL.iter().map(|v| $crate::spelling::with_others(v.spellings())).collect();
                let choices: Vec<&str> = choices.iter().map(String::as_str).collect();
                Err(format!(
                    "`{value}` is not a {}; use {}",
                    $what,
                    $crate::spelling::one_of(&choices)
                ))
            }
        }

        impl ::core::convert::TryFrom<String> for $ty {
            type Error = String;
            fn try_from(s: String) -> Result<Self, String> {
                s.parse()
            }
        }
    };
}

/// A spelling and, in brackets, its others: `FULL_SHARD (1)`.
pub fn with_others(spellings: &[&str]) -> String {
    match spellings {
        [] => String::new(),
        [one] => (*one).to_string(),
        [first, others @ ..] => format!("{first} ({})", others.join(", ")),
    }
}

/// `names` as prose: "A", "A or B", "A, B or C".
pub fn one_of(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::{one_of, with_others};

    #[test]
    fn names_read_as_prose() {
        assert_eq!(with_others(&["FULL_SHARD", "1"]), "FULL_SHARD (1)");
        assert_eq!(with_others(&["no", "fp32", "0"]), "no (fp32, 0)");
        assert_eq!(one_of(&["a"]), "a");
        assert_eq!(one_of(&["a", "b"]), "a or b");
        assert_eq!(one_of(&["a", "b", "c"]), "a, b or c");
    }
}

/// PyTorch's spelling of a device (`str(torch.device(...))`): `cpu`,
/// `cuda:0`, `mps`; what hearth's messages and `summary.json` print.
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cpu => "cpu".into(),
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        tch::Device::Mps => "mps".into(),
        tch::Device::Vulkan => "vulkan".into(),
    }
}

#[cfg(test)]
mod device_tests {
    #[test]
    fn devices_are_spelled_cpu_and_cuda_colon_index() {
        assert_eq!(super::device_name(tch::Device::Cpu), "cpu");
        assert_eq!(super::device_name(tch::Device::Cuda(1)), "cuda:1");
    }
}
