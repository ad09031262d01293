//! `HEARTH_*` environment variables fill in what the builder was not given,
//! and an explicit setting wins. One test in its own binary: it changes the
//! process environment, which other tests must not see.

use hearth::accelerator::{Accelerator, BuildError};
use hearth::precision::MixedPrecision;

#[test]
fn environment_fills_in_and_explicit_settings_win() {
    // SAFETY: this binary runs this one test, on one thread.
    unsafe {
        std::env::set_var("HEARTH_MIXED_PRECISION", "bf16");
        std::env::set_var("HEARTH_GRADIENT_ACCUMULATION_STEPS", "4");
        std::env::set_var("HEARTH_USE_CPU", "true");
    }
    let from_env = Accelerator::builder().build().unwrap();
    assert_eq!(from_env.mixed_precision(), MixedPrecision::Bf16);
    assert_eq!(from_env.gradient_accumulation_steps(), 4);
    assert_eq!(from_env.device(), tch::Device::Cpu);

    let explicit = Accelerator::builder()
        .mixed_precision(MixedPrecision::No)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    assert_eq!(explicit.mixed_precision(), MixedPrecision::No);
    assert_eq!(explicit.gradient_accumulation_steps(), 2);

    unsafe { std::env::set_var("HEARTH_GRADIENT_ACCUMULATION_STEPS", "zero") };
    let err = Accelerator::builder()
        .build()
        .err()
        .expect("a bad value is refused");
    assert!(matches!(
        err,
        BuildError::Env {
            name: "HEARTH_GRADIENT_ACCUMULATION_STEPS",
            ..
        }
    ));
    assert!(err.to_string().contains("\"zero\""), "{err}");

    unsafe {
        std::env::remove_var("HEARTH_GRADIENT_ACCUMULATION_STEPS");
        std::env::set_var("HEARTH_MIXED_PRECISION", "fp8");
    }
    let err = Accelerator::builder().build().err().unwrap().to_string();
    assert!(
        err.contains("HEARTH_MIXED_PRECISION") && err.contains("bf16"),
        "{err}"
    );
}
