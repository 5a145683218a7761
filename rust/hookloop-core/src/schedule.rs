//! fvcore's parameter schedules and detectron2's warmup, evaluated natively.
//!
//! A schedule maps training progress `where` (in [0, 1)) to a value, e.g. an LR multiplier.
//! Every formula here performs the same IEEE operations, in the same order, as the Python
//! expression in `fvcore.common.param_scheduler` / `detectron2.solver.lr_scheduler`, so the
//! values are bit-identical to Python's: `a * b + c * (1 - w)` is written as such, Python's
//! `x ** y` goes through [`py_pow`] (C `pow` plus CPython's error cases), `math.cos` is C `cos`,
//! `int(x)` truncates, and `sum(list)` is [`py_sum`] (naive before CPython 3.12, Neumaier's
//! compensated sum from 3.12 on).
//!
//! Constructors validate their arguments as fvcore does (errors name the argument), so a
//! [`Schedule`] that exists is well-formed; `value` fails only where Python would raise
//! (where out of range, a domain error, a division by zero).

use crate::error::{Error, Result};
use crate::pyexact::{py_sum, Repr, SumMode};

/// fvcore's `ParamScheduler.WHERE_EPSILON`: slack added to `where` before locating a step.
pub const WHERE_EPSILON: f64 = 1e-6;

/// Python's `x ** y` for floats: C `pow` where CPython returns its result, and an error where
/// CPython raises (0.0 to a negative power, overflow) or returns a complex number (a negative
/// base to a non-integer power). `what` names the schedule for the message.
pub fn py_pow(what: &'static str, x: f64, y: f64) -> Result<f64> {
    // CPython handles y == 0, NaNs and infinities before calling pow(); C99's pow gives the
    // same results for all of them.
    if y == 0.0 || x.is_nan() || y.is_nan() || x.is_infinite() || y.is_infinite() {
        return Ok(x.powf(y));
    }
    if x == 0.0 && y < 0.0 {
        return Err(Error::BadSchedule {
            what,
            reason: format!("0.0 cannot be raised to a negative power ({})", Repr(y)),
        });
    }
    if x < 0.0 && y != y.floor() {
        return Err(Error::BadSchedule {
            what,
            reason: format!(
                "{} ** {} is not a real number (Python would return a complex number)",
                Repr(x),
                Repr(y)
            ),
        });
    }
    let r = x.powf(y);
    if r.is_infinite() {
        return Err(Error::BadSchedule {
            what,
            reason: format!("{} ** {} overflows a float", Repr(x), Repr(y)),
        });
    }
    Ok(r)
}

/// Python's `int(x)` of a float, kept as an integral f64 (exact: `|x| < 2**53` whenever it
/// is compared with milestones, which are integers).
fn py_int(what: &'static str, x: f64) -> Result<f64> {
    if !x.is_finite() {
        return Err(Error::BadSchedule {
            what,
            reason: format!("cannot convert float {} to integer", Repr(x)),
        });
    }
    Ok(x.trunc())
}

fn bad(what: &'static str, reason: impl Into<String>) -> Error {
    Error::BadSchedule {
        what,
        reason: reason.into(),
    }
}

/// An argument error with fvcore's exact message: user code catches and matches these.
fn fvcore_bad(what: &'static str, reason: String) -> Error {
    Error::BadScheduleArg { what, reason }
}

/// Python's `"%d" % x` for a float `x`: truncated to an integer.
fn percent_d(x: f64) -> String {
    if x.is_finite() {
        format!("{}", x.trunc() as i64)
    } else {
        Repr(x).to_string()
    }
}

/// How a composite runs one of its schedules over that schedule's interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    /// The schedule sees `where` rescaled to [0, 1) over its own interval.
    Rescaled,
    /// The schedule sees the global `where`.
    Fixed,
}

impl Scaling {
    /// fvcore's spelling: `"rescaled"` or `"fixed"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "rescaled" => Ok(Scaling::Rescaled),
            "fixed" => Ok(Scaling::Fixed),
            _ => Err(bad(
                "CompositeParamScheduler",
                format!("Unsupported interval_scaling: {s:?} (expected \"rescaled\" or \"fixed\")"),
            )),
        }
    }

    /// fvcore's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Scaling::Rescaled => "rescaled",
            Scaling::Fixed => "fixed",
        }
    }
}

/// The intervals of a composite schedule: which part of training each schedule covers, and
/// how it sees `where` there. Separate from the schedules so that a composite of Python
/// schedules can locate its part with the same rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Spans {
    lengths: Vec<f64>,
    scaling: Vec<Scaling>,
}

impl Spans {
    /// fvcore's rules: at least one interval, one scaling per length, lengths summing to 1
    /// within 1e-3; when the sum is not exactly 1.0 the last length becomes
    /// `1.0 - sum(lengths[:-1])`.
    pub fn new(lengths: &[f64], scaling: Vec<Scaling>, sum: SumMode) -> Result<Self> {
        const WHAT: &str = "CompositeParamScheduler";
        if lengths.is_empty() {
            return Err(bad(
                WHAT,
                "There must be at least one scheduler in the composite scheduler",
            ));
        }
        if scaling.len() != lengths.len() {
            return Err(bad(
                WHAT,
                format!(
                    "interval_scaling must have one entry per scheduler: got {} for {} lengths",
                    scaling.len(),
                    lengths.len()
                ),
            ));
        }
        let total = py_sum(lengths, sum);
        // Stricter than fvcore, whose `abs(nan - 1.0) >= 1e-3` is false: a NaN length fails.
        if (total - 1.0).abs() >= 1e-3 || total.is_nan() {
            return Err(bad(
                WHAT,
                format!(
                    "The sum of all values in lengths must be 1, got {}",
                    Repr(total)
                ),
            ));
        }
        let mut lengths = lengths.to_vec();
        if total != 1.0 {
            let n = lengths.len();
            lengths[n - 1] = 1.0 - py_sum(&lengths[..n - 1], sum);
        }
        // Stricter than fvcore, which takes a negative length as long as the sum is 1 and
        // then maps `where` backwards through it: every length (the last one after fvcore's
        // adjustment too) is a fraction of training, >= 0 (a NaN length is refused above: its
        // sum is NaN).
        if let Some((i, &l)) = lengths.iter().enumerate().find(|(_, &l)| l < 0.0) {
            return Err(bad(
                WHAT,
                format!(
                    "lengths[{i}] must be >= 0 (a fraction of training), got {}",
                    Repr(l)
                ),
            ));
        }
        Ok(Spans { lengths, scaling })
    }

    /// The (normalized) length of each interval.
    pub fn lengths(&self) -> &[f64] {
        &self.lengths
    }

    /// The scaling of each interval.
    pub fn scaling(&self) -> &[Scaling] {
        &self.scaling
    }

    /// The number of intervals.
    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    /// Always false: a `Spans` has at least one interval.
    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// Which interval `where_` falls in, and the `where` its schedule sees: the first interval
    /// whose running total reaches `where_ + WHERE_EPSILON` (else the last), with `where_`
    /// rescaled over it when its scaling says so.
    pub fn locate(&self, where_: f64) -> Result<(usize, f64)> {
        let last = self.lengths.len() - 1;
        let mut i = 0;
        let mut running_total = self.lengths[0];
        while where_ + WHERE_EPSILON > running_total && i < last {
            i += 1;
            running_total += self.lengths[i];
        }
        match self.scaling[i] {
            Scaling::Fixed => Ok((i, where_)),
            Scaling::Rescaled => {
                let length = self.lengths[i];
                if length == 0.0 {
                    return Err(bad(
                        "CompositeParamScheduler",
                        format!(
                            "where={} falls in interval {i} of length 0 with interval_scaling \
                             'rescaled' (float division by zero)",
                            Repr(where_)
                        ),
                    ));
                }
                // fvcore's start is `running_total - length`, not the previous running total.
                let start = running_total - length;
                Ok((i, (where_ - start) / length))
            }
        }
    }
}

/// detectron2's warmup methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmupMethod {
    /// From `warmup_factor * s(0)` linearly to the schedule's value where warmup ends.
    Linear,
    /// `warmup_factor * s(0)` throughout the warmup.
    Constant,
}

impl WarmupMethod {
    /// `"linear"` or `"constant"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "linear" => Ok(WarmupMethod::Linear),
            "constant" => Ok(WarmupMethod::Constant),
            _ => Err(bad(
                "WarmupParamScheduler",
                format!(
                    "Unknown warmup method: {s} (warmup_method must be \"linear\" or \"constant\")"
                ),
            )),
        }
    }
}

/// What detectron2's `WarmupParamScheduler` builds around a schedule: the warmup stage's
/// start and end values and the composite's intervals `[warmup_length, 1 - warmup_length]`
/// with scalings `["rescaled", "rescaled" if rescale_interval else "fixed"]`.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupParts {
    /// The warmup stage's method.
    pub method: WarmupMethod,
    /// `warmup_factor * s(0.0)`.
    pub start_value: f64,
    /// `s(0.0)` when rescaling the interval, else `s(warmup_length)`.
    pub end_value: f64,
    /// The intervals of the composite.
    pub spans: Spans,
}

impl WarmupParts {
    /// Evaluates the wrapped schedule `inner` where detectron2 does. `inner` may be a Python
    /// callable (its errors pass through), hence the generic error type.
    pub fn new<E: From<Error>>(
        mut inner: impl FnMut(f64) -> std::result::Result<f64, E>,
        warmup_factor: f64,
        warmup_length: f64,
        warmup_method: &str,
        rescale_interval: bool,
        sum: SumMode,
    ) -> std::result::Result<Self, E> {
        let method = WarmupMethod::parse(warmup_method)?;
        // Stricter than detectron2 (which accepts anything and builds negative lengths).
        if !(0.0..=1.0).contains(&warmup_length) {
            return Err(bad(
                "WarmupParamScheduler",
                format!(
                    "warmup_length must be in [0, 1] (a fraction of training), got {}",
                    Repr(warmup_length)
                ),
            )
            .into());
        }
        let end_value = if rescale_interval {
            inner(0.0)?
        } else {
            inner(warmup_length)?
        };
        let start_value = warmup_factor * inner(0.0)?;
        let inner_scaling = if rescale_interval {
            Scaling::Rescaled
        } else {
            Scaling::Fixed
        };
        let spans = Spans::new(
            &[warmup_length, 1.0 - warmup_length],
            vec![Scaling::Rescaled, inner_scaling],
            sum,
        )?;
        Ok(WarmupParts {
            method,
            start_value,
            end_value,
            spans,
        })
    }

    /// The warmup stage: `Constant(start)` or `Linear(start, end)`.
    pub fn stage(&self) -> Schedule {
        match self.method {
            WarmupMethod::Constant => Schedule::constant(self.start_value),
            WarmupMethod::Linear => Schedule::linear(self.start_value, self.end_value),
        }
    }
}

/// One of fvcore's schedules, with its (validated) parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// `value` (fails for `where >= 1`).
    Constant { value: f64 },
    /// `end + 0.5 * (start - end) * (1 + cos(pi * where))`.
    Cosine { start_value: f64, end_value: f64 },
    /// `start * decay ** where`.
    Exponential { start_value: f64, decay: f64 },
    /// `end * where + start * (1 - where)`.
    Linear { start_value: f64, end_value: f64 },
    /// `values[bisect_right(milestones, int((where + eps) * num_updates))]`.
    MultiStep {
        values: Vec<f64>,
        num_updates: f64,
        milestones: Vec<f64>,
    },
    /// `base * (1 - where) ** power`.
    PolynomialDecay { base_value: f64, power: f64 },
    /// `values[int((where + eps) * len(values))]`; `num_updates` is validated only.
    Step { num_updates: f64, values: Vec<f64> },
    /// A `Step` over `base_value * gamma ** k` for k in 0..=num_decays (by repeated products).
    StepWithFixedGamma {
        base_value: f64,
        num_decays: i64,
        gamma: f64,
        num_updates: i64,
        values: Vec<f64>,
    },
    /// Each schedule over its interval of training.
    Composite {
        schedules: Vec<Schedule>,
        spans: Spans,
    },
}

/// A validated parameter schedule. Build it with the constructor named after the fvcore
/// class; evaluate it with [`Schedule::value`].
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    kind: Kind,
}

impl Schedule {
    /// The schedule and its parameters.
    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    /// fvcore's `ConstantParamScheduler(value)`.
    pub fn constant(value: f64) -> Self {
        Schedule {
            kind: Kind::Constant { value },
        }
    }

    /// fvcore's `CosineParamScheduler(start_value, end_value)`.
    pub fn cosine(start_value: f64, end_value: f64) -> Self {
        Schedule {
            kind: Kind::Cosine {
                start_value,
                end_value,
            },
        }
    }

    /// fvcore's `ExponentialParamScheduler(start_value, decay)`.
    pub fn exponential(start_value: f64, decay: f64) -> Self {
        Schedule {
            kind: Kind::Exponential { start_value, decay },
        }
    }

    /// fvcore's `LinearParamScheduler(start_value, end_value)`.
    pub fn linear(start_value: f64, end_value: f64) -> Self {
        Schedule {
            kind: Kind::Linear {
                start_value,
                end_value,
            },
        }
    }

    /// fvcore's `MultiStepParamScheduler(values, num_updates=None, milestones=None)`:
    /// without milestones, `len(values)` equal steps of `ceil(num_updates / len(values))`;
    /// without num_updates, the last milestone is the end. Milestones must be positive,
    /// strictly increasing and below `num_updates`, and `num_updates >= len(values)`.
    #[expect(
        clippy::neg_cmp_op_on_partial_ord,
        reason = "`!(a < b)` fails for NaN, as fvcore's Python checks do"
    )]
    pub fn multi_step(
        values: Vec<f64>,
        num_updates: Option<f64>,
        milestones: Option<Vec<f64>>,
    ) -> Result<Self> {
        const WHAT: &str = "MultiStepParamScheduler";
        if values.is_empty() {
            return Err(bad(WHAT, "values must not be empty"));
        }
        let (num_updates, milestones) = match (num_updates, milestones) {
            (None, None) => {
                return Err(fvcore_bad(
                    WHAT,
                    "num_updates and milestones cannot both be None".to_string(),
                ));
            }
            (Some(n), None) => {
                // math.ceil(num_updates / float(len(values))): an int, exact in f64 here.
                let step_width = (n / values.len() as f64).ceil();
                if !step_width.is_finite() {
                    return Err(bad(
                        WHAT,
                        format!("num_updates must be a finite number, got {}", Repr(n)),
                    ));
                }
                let milestones = (1..values.len()).map(|k| step_width * k as f64).collect();
                (n, milestones)
            }
            (n, Some(mut milestones)) => {
                let expected = values.len() as i64 - i64::from(n.is_some());
                if milestones.len() as i64 != expected {
                    return Err(fvcore_bad(
                        WHAT,
                        format!("MultiStep scheduler requires a list of {expected} miletones"),
                    ));
                }
                match n {
                    Some(n) => (n, milestones),
                    None => match milestones.pop() {
                        Some(n) => (n, milestones),
                        // Unreachable: milestones has len(values) >= 1 entries.
                        None => return Err(bad(WHAT, "milestones must not be empty")),
                    },
                }
            }
        };
        // `not (num_updates >= len)` so that NaN fails, as Python's comparison would.
        if !(num_updates >= values.len() as f64) {
            return Err(fvcore_bad(
                WHAT,
                "Total num_updates must be greater than length of param schedule".to_string(),
            ));
        }
        let mut start_epoch = 0.0;
        for &milestone in &milestones {
            if !(milestone < num_updates) {
                return Err(fvcore_bad(
                    WHAT,
                    format!(
                        "Milestone must be smaller than total number of updates: \
                         num_updates={}, milestone={}",
                        percent_d(num_updates),
                        percent_d(milestone)
                    ),
                ));
            }
            if !(start_epoch < milestone) {
                return Err(fvcore_bad(
                    WHAT,
                    format!(
                        "Milestone must be smaller than start epoch: start_epoch={}, milestone={}",
                        percent_d(start_epoch),
                        percent_d(milestone)
                    ),
                ));
            }
            start_epoch = milestone;
        }
        Ok(Schedule {
            kind: Kind::MultiStep {
                values,
                num_updates,
                milestones,
            },
        })
    }

    /// fvcore's `PolynomialDecayParamScheduler(base_value, power)`.
    pub fn polynomial_decay(base_value: f64, power: f64) -> Self {
        Schedule {
            kind: Kind::PolynomialDecay { base_value, power },
        }
    }

    /// fvcore's `StepParamScheduler(num_updates, values)`: `num_updates > 0`, at least one
    /// value; `values` are spread evenly over training.
    #[expect(
        clippy::neg_cmp_op_on_partial_ord,
        reason = "`!(a < b)` fails for NaN, as fvcore's Python checks do"
    )]
    pub fn step(num_updates: f64, values: Vec<f64>) -> Result<Self> {
        const WHAT: &str = "StepParamScheduler";
        if !(num_updates > 0.0) {
            return Err(bad(
                WHAT,
                format!(
                    "Number of updates must be larger than 0: num_updates={}",
                    Repr(num_updates)
                ),
            ));
        }
        if values.is_empty() {
            return Err(bad(
                WHAT,
                "Step scheduler requires a list of at least one param value (values is empty)",
            ));
        }
        Ok(Schedule {
            kind: Kind::Step {
                num_updates,
                values,
            },
        })
    }

    /// fvcore's `StepWithFixedGammaParamScheduler(base_value, num_decays, gamma,
    /// num_updates)`: positive `base_value` and `gamma`, positive integer `num_decays` and
    /// `num_updates`.
    #[expect(
        clippy::neg_cmp_op_on_partial_ord,
        reason = "`!(a < b)` fails for NaN, as fvcore's Python checks do"
    )]
    pub fn step_with_fixed_gamma(
        base_value: f64,
        num_decays: i64,
        gamma: f64,
        num_updates: i64,
    ) -> Result<Self> {
        const WHAT: &str = "StepWithFixedGammaParamScheduler";
        for (name, k) in [("base_value", base_value), ("gamma", gamma)] {
            if !(k > 0.0) {
                return Err(bad(
                    WHAT,
                    format!(
                        "base_value and gamma must be positive numbers: {name}={}",
                        Repr(k)
                    ),
                ));
            }
        }
        for (name, k) in [("num_decays", num_decays), ("num_updates", num_updates)] {
            if k <= 0 {
                return Err(bad(
                    WHAT,
                    format!("num_decays and num_updates must be positive integers: {name}={k}"),
                ));
            }
        }
        // A list of num_decays + 1 floats, as fvcore builds; refuse absurd sizes.
        if num_decays > 1 << 20 {
            return Err(bad(
                WHAT,
                format!("num_decays={num_decays} is too large (at most 1048576)"),
            ));
        }
        let mut values = Vec::with_capacity(num_decays as usize + 1);
        let mut v = base_value;
        values.push(v);
        for _ in 0..num_decays {
            v *= gamma;
            values.push(v);
        }
        Ok(Schedule {
            kind: Kind::StepWithFixedGamma {
                base_value,
                num_decays,
                gamma,
                num_updates,
                values,
            },
        })
    }

    /// fvcore's `CompositeParamScheduler(schedulers, lengths, interval_scaling)`, with the
    /// intervals already built.
    pub fn composite(schedules: Vec<Schedule>, spans: Spans) -> Result<Self> {
        if schedules.len() != spans.len() {
            return Err(bad(
                "CompositeParamScheduler",
                format!(
                    "Schedulers and lengths must be same length: {} schedulers, {} lengths",
                    schedules.len(),
                    spans.len()
                ),
            ));
        }
        Ok(Schedule {
            kind: Kind::Composite { schedules, spans },
        })
    }

    /// detectron2's `WarmupParamScheduler(scheduler, warmup_factor, warmup_length,
    /// warmup_method, rescale_interval)`: a composite of the warmup stage and `inner`.
    pub fn warmup(
        inner: Schedule,
        warmup_factor: f64,
        warmup_length: f64,
        warmup_method: &str,
        rescale_interval: bool,
        sum: SumMode,
    ) -> Result<Self> {
        let parts = WarmupParts::new(
            |w| inner.value(w),
            warmup_factor,
            warmup_length,
            warmup_method,
            rescale_interval,
            sum,
        )?;
        Schedule::composite(vec![parts.stage(), inner], parts.spans)
    }

    /// The value at training progress `where_`, computed as fvcore's Python does.
    pub fn value(&self, where_: f64) -> Result<f64> {
        match &self.kind {
            Kind::Constant { value } => {
                if where_ >= 1.0 {
                    return Err(Error::WhereOutOfRange {
                        what: "ConstantParamScheduler",
                        range: "[0, 1)",
                        where_,
                    });
                }
                Ok(*value)
            }
            Kind::Cosine {
                start_value,
                end_value,
            } => {
                let angle = std::f64::consts::PI * where_;
                if angle.is_infinite() {
                    // fvcore's math.cos(inf) raises ValueError("math domain error"). A finite
                    // `where` outside [0, 1] is fvcore's too: the cosine continues there.
                    return Err(Error::bad_value(
                        "where in CosineParamScheduler",
                        format!(
                            "must be finite (math.cos of it is a domain error): got {}",
                            Repr(where_)
                        ),
                    ));
                }
                Ok(end_value + 0.5 * (start_value - end_value) * (1.0 + angle.cos()))
            }
            Kind::Exponential { start_value, decay } => {
                Ok(start_value * py_pow("ExponentialParamScheduler", *decay, where_)?)
            }
            Kind::Linear {
                start_value,
                end_value,
            } => Ok(end_value * where_ + start_value * (1.0 - where_)),
            Kind::MultiStep {
                values,
                num_updates,
                milestones,
            } => {
                const WHAT: &str = "MultiStepParamScheduler";
                if where_ > 1.0 {
                    return Err(Error::WhereOutOfRange {
                        what: WHAT,
                        range: "[0, 1]",
                        where_,
                    });
                }
                let epoch_num = py_int(WHAT, (where_ + WHERE_EPSILON) * num_updates)?;
                // bisect_right over strictly increasing milestones.
                let index = milestones.partition_point(|&m| m <= epoch_num);
                Ok(values[index])
            }
            Kind::PolynomialDecay { base_value, power } => {
                Ok(base_value * py_pow("PolynomialDecayParamScheduler", 1.0 - where_, *power)?)
            }
            Kind::Step { values, .. } => step_value("StepParamScheduler", values, where_),
            Kind::StepWithFixedGamma { values, .. } => {
                step_value("StepWithFixedGammaParamScheduler", values, where_)
            }
            Kind::Composite { schedules, spans } => {
                let (i, sub_where) = spans.locate(where_)?;
                schedules[i].value(sub_where)
            }
        }
    }

    /// The LR multiplier `LRMultiplier` applies after `iter` steps of `max_iter`:
    /// `value(iter / max_iter)`, with [`progress`]'s checks.
    pub fn multiplier(&self, iter: i64, max_iter: i64) -> Result<f64> {
        self.value(progress(iter, max_iter)?)
    }
}

fn step_value(what: &'static str, values: &[f64], where_: f64) -> Result<f64> {
    let index = py_int(what, (where_ + WHERE_EPSILON) * values.len() as f64)?;
    // Past the end fvcore's list indexing raises IndexError (at where=1.0 too).
    if index >= values.len() as f64 {
        return Err(Error::StepPastEnd { what, where_ });
    }
    // Python would index from the end for a negative `where`; that is no schedule.
    if index < 0.0 {
        return Err(Error::WhereOutOfRange {
            what,
            range: "[0, 1)",
            where_,
        });
    }
    Ok(values[index as usize])
}

/// `LRMultiplier`'s training progress after `iter` steps of `max_iter`: `iter / max_iter`
/// (correctly rounded, as Python's int division). `iter == max_iter` is allowed: the
/// scheduler steps once more after the last iteration. Past it the schedule is undefined,
/// and the error names the iteration.
pub fn progress(iter: i64, max_iter: i64) -> Result<f64> {
    if max_iter <= 0 {
        return Err(bad(
            "LRMultiplier",
            format!("max_iter must be a positive integer, got {max_iter}"),
        ));
    }
    if iter < 0 || iter > max_iter {
        return Err(Error::IterOutOfRange { iter, max_iter });
    }
    // Both are below 2**53 in any real run, so the conversions are exact and the division
    // rounds once, as Python's `int / int` does.
    Ok(iter as f64 / max_iter as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: SumMode = SumMode::Naive;

    fn bits_eq(a: f64, b: f64) {
        assert_eq!(a.to_bits(), b.to_bits(), "{a:?} != {b:?}");
    }

    fn grid() -> Vec<f64> {
        let mut w: Vec<f64> = (0..1000).map(|i| i as f64 / 1000.0).collect();
        w.extend((0..90000).step_by(997).map(|i| i as f64 / 90000.0));
        w.extend([1e-7, 0.3 - 1e-6, 0.3, 0.5 - 1e-6, 0.999_999, 0.999_999_5]);
        w
    }

    fn reason(err: Error) -> String {
        err.to_string()
    }

    #[test]
    fn constant() {
        let s = Schedule::constant(0.42);
        for w in grid() {
            bits_eq(s.value(w).unwrap(), 0.42);
        }
        let err = s.value(1.0).unwrap_err();
        assert!(matches!(err, Error::WhereOutOfRange { .. }));
        assert_eq!(
            err.to_string(),
            "where in ConstantParamScheduler must be in [0, 1): got 1.0"
        );
        // NaN >= 1.0 is false in Python too.
        bits_eq(s.value(f64::NAN).unwrap(), 0.42);
    }

    #[test]
    fn cosine_matches_formula() {
        let s = Schedule::cosine(0.1, 0.0001);
        for w in grid() {
            let expected = 0.0001 + 0.5 * (0.1 - 0.0001) * (1.0 + (std::f64::consts::PI * w).cos());
            bits_eq(s.value(w).unwrap(), expected);
        }
        bits_eq(s.value(0.0).unwrap(), 0.1);
        // Known Python value: fvcore CosineParamScheduler(0.1, 0.0001)(0.5)
        bits_eq(s.value(0.5).unwrap(), 0.050050000000000004);
        // Outside [0, 1] the cosine continues, as fvcore's; inf is fvcore's ValueError.
        bits_eq(
            s.value(1.5).unwrap(),
            0.0001 + 0.5 * (0.1 - 0.0001) * (1.0 + (std::f64::consts::PI * 1.5).cos()),
        );
        for w in [f64::INFINITY, f64::NEG_INFINITY] {
            match s.value(w) {
                Err(Error::BadValue { what, reason }) => {
                    assert_eq!(what, "where in CosineParamScheduler");
                    assert!(reason.ends_with(&format!("got {}", Repr(w))), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(s.value(f64::NAN).unwrap().is_nan());
    }

    #[test]
    fn exponential_and_polynomial() {
        let e = Schedule::exponential(2.0, 0.02);
        let p = Schedule::polynomial_decay(0.1, 0.9);
        for w in grid() {
            bits_eq(e.value(w).unwrap(), 2.0 * 0.02_f64.powf(w));
            bits_eq(p.value(w).unwrap(), 0.1 * (1.0 - w).powf(0.9));
        }
        bits_eq(e.value(0.0).unwrap(), 2.0);
        bits_eq(p.value(1.0).unwrap(), 0.0);
        // Python: (1 - 1.5) ** 0.9 is complex; 0.0 ** -1 raises.
        assert!(p.value(1.5).is_err());
        assert!(Schedule::polynomial_decay(1.0, -1.0).value(1.0).is_err());
        // An integer power of a negative base is real.
        bits_eq(
            Schedule::polynomial_decay(1.0, 2.0).value(3.0).unwrap(),
            4.0,
        );
        assert!(Schedule::exponential(1.0, -2.0).value(0.5).is_err());
        assert!(Schedule::exponential(1.0, 1e300).value(2.0).is_err());
    }

    #[test]
    fn py_pow_special_cases() {
        bits_eq(py_pow("t", f64::NAN, 0.0).unwrap(), 1.0);
        bits_eq(py_pow("t", 1.0, f64::NAN).unwrap(), 1.0);
        bits_eq(py_pow("t", 0.0, 0.5).unwrap(), 0.0);
        bits_eq(py_pow("t", -2.0, 3.0).unwrap(), -8.0);
        bits_eq(py_pow("t", -0.0, 3.0).unwrap(), -0.0);
        bits_eq(py_pow("t", 0.5, f64::INFINITY).unwrap(), 0.0);
        assert!(py_pow("t", 0.0, -0.5).is_err());
        assert!(py_pow("t", 10.0, 400.0).is_err());
        // Underflow is silent in Python.
        bits_eq(py_pow("t", 10.0, -400.0).unwrap(), 0.0);
    }

    #[test]
    fn linear_matches_formula() {
        let s = Schedule::linear(0.0001, 0.01);
        for w in grid() {
            bits_eq(s.value(w).unwrap(), 0.01 * w + 0.0001 * (1.0 - w));
        }
    }

    #[test]
    fn multi_step_explicit_milestones() {
        let s = Schedule::multi_step(
            vec![0.1, 0.01, 0.001, 0.0001],
            Some(120.0),
            Some(vec![30.0, 60.0, 80.0]),
        )
        .unwrap();
        for epoch in 0..=120 {
            let w = epoch as f64 / 120.0;
            let expected = match epoch {
                0..=29 => 0.1,
                30..=59 => 0.01,
                60..=79 => 0.001,
                _ => 0.0001,
            };
            bits_eq(s.value(w).unwrap(), expected);
        }
        // Past 1.0 fails; 1.0 itself is the last value (fvcore checks `where > 1`).
        bits_eq(s.value(1.0).unwrap(), 0.0001);
        assert_eq!(
            reason(s.value(1.0 + 1e-9).unwrap_err()),
            "where in MultiStepParamScheduler must be in [0, 1]: got 1.000000001"
        );
        assert!(s.value(f64::NAN).is_err());
    }

    #[test]
    fn multi_step_equivalent_forms() {
        // fvcore's docstring: all of these define the same schedule.
        let a =
            Schedule::multi_step(vec![1.0, 0.1, 0.01], Some(90.0), Some(vec![30.0, 60.0])).unwrap();
        let b = Schedule::multi_step(vec![1.0, 0.1, 0.01], Some(90.0), None).unwrap();
        let c =
            Schedule::multi_step(vec![1.0, 0.1, 0.01], None, Some(vec![30.0, 60.0, 90.0])).unwrap();
        let d =
            Schedule::multi_step(vec![1.0, 0.1, 0.01], None, Some(vec![3.0, 6.0, 9.0])).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        for w in grid() {
            let v = a.value(w).unwrap();
            bits_eq(d.value(w).unwrap(), v);
        }
        // Default milestones: ceil(num_updates / len(values)) steps.
        let e = Schedule::multi_step(vec![1.0, 0.5, 0.25], Some(100.0), None).unwrap();
        match e.kind() {
            Kind::MultiStep { milestones, .. } => assert_eq!(milestones, &[34.0, 68.0]),
            k => panic!("{k:?}"),
        }
    }

    #[test]
    fn multi_step_epsilon_boundary() {
        // int((29.99999/90 + 1e-6) * 90) reaches 30 just below the boundary, as in Python.
        let s = Schedule::multi_step(vec![1.0, 0.1], Some(90.0), Some(vec![30.0])).unwrap();
        let w = 29.99995 / 90.0;
        let epoch = ((w + 1e-6) * 90.0_f64).trunc();
        let expected = if epoch >= 30.0 { 0.1 } else { 1.0 };
        bits_eq(s.value(w).unwrap(), expected);
        bits_eq(s.value(29.0 / 90.0).unwrap(), 1.0);
    }

    #[test]
    fn multi_step_bad_args() {
        type Case = (Vec<f64>, Option<f64>, Option<Vec<f64>>, &'static str);
        let cases: Vec<Case> = vec![
            (vec![1.0], None, None, "cannot both be None"),
            (
                vec![1.0, 0.1],
                Some(10.0),
                Some(vec![3.0, 6.0]),
                "list of 1 miletones",
            ),
            (vec![1.0, 0.1], None, Some(vec![3.0]), "list of 2 miletones"),
            (vec![1.0, 0.1, 0.01], Some(2.0), None, "greater than length"),
            (
                vec![1.0, 0.1],
                Some(10.0),
                Some(vec![10.0]),
                "num_updates=10, milestone=10",
            ),
            (
                vec![1.0, 0.1, 0.01],
                Some(10.0),
                Some(vec![6.0, 3.0]),
                "start_epoch=6, milestone=3",
            ),
            (
                vec![1.0, 0.1],
                Some(10.0),
                Some(vec![0.0]),
                "start_epoch=0, milestone=0",
            ),
            (vec![], Some(10.0), None, "values must not be empty"),
            (vec![], None, Some(vec![]), "values must not be empty"),
            (vec![1.0], Some(f64::NAN), None, "num_updates"),
        ];
        for (values, n, m, needle) in cases {
            let err = Schedule::multi_step(values.clone(), n, m.clone()).unwrap_err();
            assert!(matches!(
                err,
                Error::BadSchedule {
                    what: "MultiStepParamScheduler",
                    ..
                } | Error::BadScheduleArg {
                    what: "MultiStepParamScheduler",
                    ..
                }
            ));
            let msg = err.to_string();
            assert!(msg.contains(needle), "{values:?} {n:?} {m:?}: {msg}");
        }
    }

    #[test]
    fn step_and_fixed_gamma() {
        let s = Schedule::step(120.0, vec![0.1, 0.01, 0.001, 0.0001]).unwrap();
        for epoch in 0..120 {
            let w = epoch as f64 / 120.0;
            let expected = [0.1, 0.01, 0.001, 0.0001][epoch / 30];
            bits_eq(s.value(w).unwrap(), expected);
        }
        // fvcore indexes past the end at where=1.0 (IndexError); negative where is refused.
        assert!(matches!(s.value(1.0), Err(Error::StepPastEnd { .. })));
        assert_eq!(reason(s.value(1.0).unwrap_err()), "list index out of range");
        assert!(s.value(-0.5).is_err());
        assert!(Schedule::step(0.0, vec![1.0]).is_err());
        assert!(Schedule::step(10.0, vec![]).is_err());

        let g = Schedule::step_with_fixed_gamma(0.1, 3, 0.1, 120).unwrap();
        // values are built by repeated products: 0.1, 0.1*0.1, (0.1*0.1)*0.1, ...
        let v = [0.1, 0.1 * 0.1, 0.1 * 0.1 * 0.1, 0.1 * 0.1 * 0.1 * 0.1];
        for epoch in 0..120 {
            bits_eq(g.value(epoch as f64 / 120.0).unwrap(), v[epoch / 30]);
        }
        for (b, n, gm, u, needle) in [
            (0.0, 3, 0.1, 120, "base_value=0.0"),
            (0.1, 3, -0.1, 120, "gamma=-0.1"),
            (0.1, 0, 0.1, 120, "num_decays=0"),
            (0.1, 3, 0.1, -1, "num_updates=-1"),
            (f64::NAN, 3, 0.1, 1, "base_value=nan"),
        ] {
            let msg = reason(Schedule::step_with_fixed_gamma(b, n, gm, u).unwrap_err());
            assert!(msg.contains(needle), "{msg}");
        }
    }

    /// fvcore's composite locate, transcribed literally for comparison.
    fn composite_reference(
        parts: &[Schedule],
        lengths: &[f64],
        scaling: &[Scaling],
        w: f64,
    ) -> f64 {
        let mut i = 0;
        let mut running_total = lengths[0];
        while w + 1e-6 > running_total && i < parts.len() - 1 {
            i += 1;
            running_total += lengths[i];
        }
        let mut sw = w;
        if scaling[i] == Scaling::Rescaled {
            let start = running_total - lengths[i];
            sw = (w - start) / lengths[i];
        }
        parts[i].value(sw).unwrap()
    }

    #[test]
    fn composite_matches_reference() {
        let parts = vec![Schedule::constant(0.42), Schedule::cosine(0.42, 1e-4)];
        for scaling in [
            vec![Scaling::Rescaled, Scaling::Rescaled],
            vec![Scaling::Rescaled, Scaling::Fixed],
            vec![Scaling::Fixed, Scaling::Fixed],
        ] {
            let spans = Spans::new(&[0.3, 0.7], scaling.clone(), N).unwrap();
            let s = Schedule::composite(parts.clone(), spans).unwrap();
            for w in grid() {
                bits_eq(
                    s.value(w).unwrap(),
                    composite_reference(&parts, &[0.3, 0.7], &scaling, w),
                );
            }
        }
    }

    #[test]
    fn composite_lengths_normalized() {
        // 0.1 + 0.2 + 0.7 != 1.0 in floats: the last length becomes 1.0 - (0.1 + 0.2).
        let spans = Spans::new(&[0.1, 0.2, 0.7], vec![Scaling::Fixed; 3], N).unwrap();
        bits_eq(spans.lengths()[2], 1.0 - (0.1 + 0.2));
        let spans = Spans::new(&[0.5, 0.5], vec![Scaling::Fixed; 2], N).unwrap();
        assert_eq!(spans.lengths(), &[0.5, 0.5]);
        // Within 1e-3 passes (and is fixed up); beyond fails.
        let spans = Spans::new(&[0.5, 0.5005], vec![Scaling::Fixed; 2], N).unwrap();
        bits_eq(spans.lengths()[1], 0.5);
        let msg = reason(Spans::new(&[0.5, 0.6], vec![Scaling::Fixed; 2], N).unwrap_err());
        assert!(msg.contains("must be 1"), "{msg}");
        assert!(Spans::new(&[], vec![], N).is_err());
        assert!(Spans::new(&[1.0], vec![], N).is_err());
        assert!(Spans::new(&[f64::NAN], vec![Scaling::Fixed], N).is_err());
        assert!(Scaling::parse("scaled").is_err());
        let parts = vec![Schedule::constant(1.0)];
        let spans = Spans::new(&[0.5, 0.5], vec![Scaling::Fixed; 2], N).unwrap();
        assert!(Schedule::composite(parts, spans).is_err());
    }

    #[test]
    fn composite_refuses_negative_lengths() {
        for (lengths, index, shown) in [
            (vec![1.5, -0.5], 1, "-0.5"),
            (vec![-0.25, 1.25], 0, "-0.25"),
            // Within fvcore's 1e-3 of 1, the last length is adjusted to a negative one.
            (vec![1.0005, 0.0], 1, "-0.0004999999999999449"),
        ] {
            match Spans::new(&lengths, vec![Scaling::Rescaled; 2], SumMode::Naive) {
                Err(Error::BadSchedule { what, reason }) => {
                    assert_eq!(what, "CompositeParamScheduler");
                    assert_eq!(
                        reason,
                        format!(
                            "lengths[{index}] must be >= 0 (a fraction of training), got {shown}"
                        )
                    );
                }
                other => panic!("{lengths:?}: {other:?}"),
            }
        }
        assert!(Spans::new(&[1.0, 0.0], vec![Scaling::Rescaled; 2], SumMode::Naive).is_ok());
    }

    #[test]
    fn composite_zero_length_rescaled() {
        let spans = Spans::new(&[1.0, 0.0], vec![Scaling::Rescaled; 2], N).unwrap();
        let s = Schedule::composite(
            vec![Schedule::constant(1.0), Schedule::constant(2.0)],
            spans,
        )
        .unwrap();
        bits_eq(s.value(0.5).unwrap(), 1.0);
        assert!(s.value(1.0).is_err());
    }

    /// detectron2's WarmupParamScheduler, transcribed: a composite of the warmup stage.
    fn warmup_reference(
        inner: &Schedule,
        factor: f64,
        length: f64,
        method: &str,
        rescale: bool,
    ) -> Schedule {
        let end = if rescale {
            inner.value(0.0).unwrap()
        } else {
            inner.value(length).unwrap()
        };
        let start = factor * inner.value(0.0).unwrap();
        let stage = if method == "constant" {
            Schedule::constant(start)
        } else {
            Schedule::linear(start, end)
        };
        let scaling = vec![
            Scaling::Rescaled,
            if rescale {
                Scaling::Rescaled
            } else {
                Scaling::Fixed
            },
        ];
        Schedule::composite(
            vec![stage, inner.clone()],
            Spans::new(&[length, 1.0 - length], scaling, N).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn warmup_multi_step() {
        let max_iter = 90000_i64;
        let inner = Schedule::multi_step(
            vec![1.0, 0.1, 0.01],
            Some(90000.0),
            Some(vec![60000.0, 80000.0]),
        )
        .unwrap();
        let length = 100.0 / 90000.0;
        for method in ["linear", "constant"] {
            for rescale in [false, true] {
                let s = Schedule::warmup(inner.clone(), 0.001, length, method, rescale, N).unwrap();
                assert_eq!(s, warmup_reference(&inner, 0.001, length, method, rescale));
                for it in (0..=max_iter)
                    .step_by(7)
                    .chain([99, 100, 101, 59999, 60000, 90000])
                {
                    let m = s.multiplier(it, max_iter).unwrap();
                    let r = warmup_reference(&inner, 0.001, length, method, rescale)
                        .value(it as f64 / max_iter as f64)
                        .unwrap();
                    bits_eq(m, r);
                }
            }
        }
        let s = Schedule::warmup(inner.clone(), 0.001, length, "linear", false, N).unwrap();
        bits_eq(s.multiplier(0, max_iter).unwrap(), 0.001);
        bits_eq(s.multiplier(200, max_iter).unwrap(), 1.0);
        bits_eq(s.multiplier(70000, max_iter).unwrap(), 0.1);
        bits_eq(s.multiplier(max_iter, max_iter).unwrap(), 0.01);
        // Linear warmup: 0.001 * (1 - w') + 1 * w' at w' = 50 / 100, via the formula.
        let w = 50.0 / 90000.0;
        let start = length - length;
        let sub = (w - start) / length;
        bits_eq(
            s.multiplier(50, max_iter).unwrap(),
            1.0 * sub + 0.001 * (1.0 - sub),
        );
    }

    #[test]
    fn warmup_edge_cases() {
        let inner = Schedule::cosine(1.0, 0.0);
        // No warmup at all: the inner schedule from the start.
        let s = Schedule::warmup(inner.clone(), 0.001, 0.0, "linear", false, N).unwrap();
        for w in grid() {
            bits_eq(s.value(w).unwrap(), inner.value(w).unwrap());
        }
        // Warmup over all of training.
        let s = Schedule::warmup(inner.clone(), 0.5, 1.0, "constant", false, N).unwrap();
        bits_eq(s.value(0.99).unwrap(), 0.5);
        let msg = reason(Schedule::warmup(inner.clone(), 0.1, 0.1, "exp", false, N).unwrap_err());
        assert!(msg.contains("Unknown warmup method: exp"), "{msg}");
        assert!(Schedule::warmup(inner.clone(), 0.1, 1.5, "linear", false, N).is_err());
        assert!(Schedule::warmup(inner.clone(), 0.1, -0.1, "linear", false, N).is_err());
        assert!(Schedule::warmup(inner, 0.1, f64::NAN, "linear", false, N).is_err());
        // The wrapped schedule's errors surface at construction.
        let s = Schedule::warmup(Schedule::constant(1.0), 0.1, 1.0, "linear", false, N);
        assert!(matches!(s, Err(Error::WhereOutOfRange { .. })));
    }

    #[test]
    fn nested_composites() {
        let inner =
            Schedule::warmup(Schedule::cosine(1.0, 0.0), 0.01, 0.05, "linear", true, N).unwrap();
        let spans = Spans::new(&[0.5, 0.5], vec![Scaling::Rescaled, Scaling::Fixed], N).unwrap();
        let s =
            Schedule::composite(vec![inner.clone(), Schedule::linear(0.5, 0.0)], spans).unwrap();
        for w in grid() {
            let expected = if w + 1e-6 > 0.5 {
                0.0 * w + 0.5 * (1.0 - w)
            } else {
                inner.value((w - (0.5 - 0.5)) / 0.5).unwrap()
            };
            bits_eq(s.value(w).unwrap(), expected);
        }
    }

    #[test]
    fn progress_and_resume() {
        bits_eq(progress(0, 90000).unwrap(), 0.0);
        bits_eq(progress(30000, 90000).unwrap(), 30000.0 / 90000.0);
        bits_eq(progress(90000, 90000).unwrap(), 1.0);
        let err = progress(90001, 90000).unwrap_err();
        assert!(matches!(
            err,
            Error::IterOutOfRange {
                iter: 90001,
                max_iter: 90000
            }
        ));
        let msg = err.to_string();
        assert!(
            msg.contains("iteration 90001") && msg.contains("max_iter=90000"),
            "{msg}"
        );
        assert!(progress(-1, 10).is_err());
        assert!(progress(0, 0).unwrap_err().to_string().contains("max_iter"));
    }
}
