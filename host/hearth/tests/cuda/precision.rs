//! Mixed precision on the GPU: fp16 loss scaling, bf16 and fp16 training,
//! and hearth's loss kernels for half logits against libtorch's.

use super::{cuda, Constant, SMALL_GPT};
use hearth::accelerator::{Accelerator, LrSchedule};
use hearth::models::{Gpt, Model};
use hearth::ops::{AdamHyper, SgdHyper};
use hearth::optim::{Adam, Sgd};
use hearth::precision::MixedPrecision;
use tch::{Device, Kind, Tensor};

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_on_cuda_scales_skips_and_backs_off() {
    let device = cuda();
    let mut acc = Accelerator::builder()
        .mixed_precision(MixedPrecision::Fp16)
        .build()
        .unwrap();
    assert_eq!(acc.device(), device);
    let p = Tensor::ones([4], (Kind::Float, device)).set_requires_grad(true);
    let opt = Sgd::new(
        vec![p.shallow_clone()],
        SgdHyper {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
    );
    let schedule: Box<dyn LrSchedule> = Box::new(Constant);
    let (mut opt, mut sched) = acc.prepare((opt, schedule)).unwrap();
    let mut step = |factor: f64| {
        let y = {
            let _autocast = acc.autocast().expect("fp16 autocasts on CUDA");
            let w = Tensor::ones([4, 4], (Kind::Float, device));
            let y = p.unsqueeze(0).matmul(&w);
            assert_eq!(y.kind(), Kind::Half, "matmul runs in fp16 under autocast");
            y
        };
        acc.backward(&(y.to_kind(Kind::Float).sum(Kind::Float) * factor))
            .unwrap();
        let norm =
            f64::try_from(acc.clip_grad_norm_(&mut opt, 1e9, 2.0).unwrap().unwrap()).unwrap();
        opt.step().unwrap();
        sched.step().unwrap();
        opt.zero_grad();
        (opt.step_was_skipped(), acc.loss_scale().unwrap(), norm)
    };
    // The loss is scaled by 8 below 1 so that its scaled gradients fit in
    // fp16: at the initial scale 2^16 a gradient of 1 is 65536, past fp16's
    // largest finite 65504, and PyTorch's GradScaler skips that step too.
    let (skipped, scale, norm) = step(0.125);
    assert!(!skipped);
    assert_eq!(scale, 65536.0);
    assert!((norm - 1.0).abs() < 1e-3, "unscaled gradient norm {norm}");
    let (skipped, scale, _) = step(f64::NAN);
    assert!(skipped && scale == 32768.0);
    let (skipped, _, _) = step(0.125);
    assert!(!skipped);
    // A gradient of 1 overflows at 2^15 too (×4 through the matmul):
    // skipped, and the scale halves again.
    let (skipped, scale, _) = step(1.0);
    assert!(skipped && scale == 16384.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_gpt_trains_under_bf16_and_fp16_on_cuda() {
    let device = cuda();
    for mode in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        tch::manual_seed(0);
        let mut acc = Accelerator::builder()
            .mixed_precision(mode)
            .gradient_accumulation_steps(2)
            .build()
            .unwrap();
        let config = SMALL_GPT;
        let model = Gpt::new(config, Device::Cpu);
        let opt = Adam::new(
            model
                .named_parameters()
                .into_iter()
                .map(|(_, t)| t)
                .collect::<Vec<_>>(),
            AdamHyper {
                weight_decay: 0.0,
                ..AdamHyper::adamw(3e-3)
            },
        );
        let (model, mut opt) = acc.prepare((model, opt)).unwrap();
        assert!(model
            .named_parameters()
            .iter()
            .all(|(_, t)| t.device() == device));
        let x = Tensor::randint(16, [8, 8], (Kind::Int64, device));
        let mut losses = Vec::new();
        for _ in 0..60 {
            let loss = acc.accumulate(|| {
                let logits = model.forward_t(&x, true);
                assert_eq!(logits.kind(), Kind::Float, "prepared outputs are fp32");
                let loss = logits
                    .view([-1, 16])
                    .cross_entropy_for_logits(&x.view([-1]));
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
                f64::try_from(&loss).unwrap()
            });
            losses.push(loss);
        }
        assert!(
            losses[losses.len() - 1] < losses[0] * 0.5,
            "{mode}: loss {} → {}",
            losses[0],
            losses[losses.len() - 1]
        );
    }
}

/// Half-precision logits on a GPU (float16 by `_log_softmax` reading them
/// as they are, bfloat16 cast first; `lm_loss`) are scored as float32 ones:
/// the loss and the logits' gradient are those of casting them to float32
/// first, as autocast does, to within one rounding of the gradient to the
/// logits' precision.
#[test]
#[ignore = "needs a CUDA GPU"]
fn half_logits_are_scored_on_cuda_as_float32_ones() {
    let device = cuda();
    tch::manual_seed(3);
    for kind in [Kind::BFloat16, Kind::Half] {
        let logits = (Tensor::randn([4, 96, 1000], (Kind::Float, device)) * 4.0).to_kind(kind);
        let targets = Tensor::randint(1000, [4, 96], (Kind::Int64, device));
        let _ = targets.narrow(1, 0, 7).fill_(hearth::data::IGNORE_INDEX);
        let ours = logits.detach().set_requires_grad(true);
        let loss = hearth::train::lm_loss(&ours, &targets);
        loss.backward();
        let cast = logits.detach().set_requires_grad(true);
        let reference = cast
            .to_kind(Kind::Float)
            .view([-1, 1000])
            .cross_entropy_loss::<Tensor>(
                &targets.view([-1]),
                None,
                tch::Reduction::Mean,
                hearth::data::IGNORE_INDEX,
                0.0,
            );
        reference.backward();
        assert_eq!(loss.kind(), Kind::Float, "{kind:?}: a float32 loss");
        let (a, b) = (
            f64::try_from(&loss).unwrap(),
            f64::try_from(&reference).unwrap(),
        );
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{kind:?}: loss {a} vs {b}");
        let (ga, gb) = (ours.grad(), cast.grad());
        assert_eq!(ga.kind(), kind, "the gradient in the logits' precision");
        let diff = f64::try_from(
            (ga.to_kind(Kind::Float) - gb.to_kind(Kind::Float))
                .abs()
                .max(),
        )
        .unwrap();
        let scale = f64::try_from(gb.to_kind(Kind::Float).abs().max()).unwrap();
        assert!(
            diff <= scale / 128.0,
            "{kind:?}: gradients differ by {diff} (largest {scale})"
        );
    }
}

/// bfloat16 logits on a GPU are scored by hearth's own kernels, and their
/// loss and gradient are libtorch's — `cross_entropy` of the logits cast
/// to float32, the gradient cast back — to float32 rounding: the loss to
/// 1e-5, each gradient element to one bfloat16 step (the two float32
/// values may fall on either side of a rounding boundary) plus 1e-4 of the
/// largest gradient a row can have (the loss's gradient over the scored
/// rows): where a target's probability is near 1, `p - 1` cancels, and
/// both sides' float32 log-sum-exp (a few ulps of up to ~100 here) leaves
/// an error of that order in either. Shapes: GPT-2's
/// vocabulary (8 values per load), an odd one (one at a time), rows that
/// start off 16 bytes, peaked and flat rows, targets at both ends,
/// ignored rows, and a batch with every row ignored (NaN, as libtorch).
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_cross_entropy_kernels_agree_with_libtorch() {
    let device = cuda();
    hearth::ops::cuda_loss::available(0).expect("the kernels compile and load on this GPU");
    tch::manual_seed(11);
    let ignore = hearth::data::IGNORE_INDEX;
    for (rows, vocab, spread, offset) in [
        (512, 50304, 4.0, 0),
        (300, 1001, 8.0, 0),
        (64, 4096, 30.0, 1),
        (33, 8, 1.0, 0),
    ] {
        let name = format!("{rows}x{vocab} (spread {spread}, offset {offset})");
        let backing = (Tensor::randn([rows * vocab + offset], (Kind::Float, device)) * spread)
            .to_kind(Kind::BFloat16);
        let logits = backing.narrow(0, offset, rows * vocab).view([rows, vocab]);
        let targets = Tensor::randint(vocab, [rows], (Kind::Int64, device));
        let _ = targets.narrow(0, 0, 5).fill_(ignore);
        let _ = targets.narrow(0, 5, 1).fill_(0);
        let _ = targets.narrow(0, 6, 1).fill_(vocab - 1);
        let ours = logits.detach().set_requires_grad(true);
        let loss = hearth::ops::cuda_loss::bf16_cross_entropy(&ours, &targets, ignore)
            .expect("the kernels take these logits");
        (&loss * 3.0).backward();
        let cast = logits.detach().set_requires_grad(true);
        let reference = cast.to_kind(Kind::Float).cross_entropy_loss::<Tensor>(
            &targets,
            None,
            tch::Reduction::Mean,
            ignore,
            0.0,
        );
        (&reference * 3.0).backward();
        assert_eq!(loss.kind(), Kind::Float, "{name}: a float32 loss");
        let (a, b) = (
            f64::try_from(&loss).unwrap(),
            f64::try_from(&reference).unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{name}: loss {a} vs {b}");
        let (ga, gb) = (
            ours.grad().to_kind(Kind::Float),
            cast.grad().to_kind(Kind::Float),
        );
        assert_eq!(
            ours.grad().kind(),
            Kind::BFloat16,
            "{name}: a bf16 gradient"
        );
        let scored = i64::try_from(targets.ne(ignore).sum(Kind::Int64)).unwrap();
        let allowed = gb.abs() / 128.0 + 1e-4 * 3.0 / scored as f64;
        let over = i64::try_from((&ga - &gb).abs().gt_tensor(&allowed).sum(Kind::Int64)).unwrap();
        let worst = f64::try_from((&ga - &gb).abs().max()).unwrap();
        assert_eq!(
            over, 0,
            "{name}: {over} gradient elements off by more than a bf16 step (worst {worst})"
        );
        let ignored = f64::try_from(ours.grad().narrow(0, 0, 5).abs().sum(Kind::Float)).unwrap();
        assert_eq!(ignored, 0.0, "{name}: ignored rows get no gradient");
    }
    let logits = Tensor::randn([4, 64], (Kind::Float, device)).to_kind(Kind::BFloat16);
    let none = Tensor::full([4], ignore, (Kind::Int64, device));
    let loss = hearth::ops::cuda_loss::bf16_cross_entropy(&logits, &none, ignore).unwrap();
    assert!(
        f64::try_from(&loss).unwrap().is_nan(),
        "every row ignored: NaN, as libtorch"
    );
}
