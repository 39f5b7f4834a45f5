//! Every loss scaler is a kiln-state [`Stateful`] component: its [`ScalerState`] as the
//! metadata entry `scaler` of a [`StateDict`].

use crate::scaler::{LossScaler, NoScaler, ScalerState, StaticLossScaler};
use crate::DynamicLossScaler;
use kiln_state::{StateDict, StateError, Stateful};

const KEY: &str = "scaler";

fn save(s: &(impl LossScaler + ?Sized)) -> kiln_state::Result<StateDict> {
    let mut sd = StateDict::new();
    sd.set_meta(KEY, s.scaler_state())?;
    Ok(sd)
}

fn load(s: &mut (impl LossScaler + ?Sized), sd: &StateDict) -> kiln_state::Result<()> {
    let state: ScalerState = sd.meta(KEY)?;
    s.load_scaler_state(&state)
        .map_err(|e| StateError::component("loss scaler", e))
}

macro_rules! stateful_scaler {
    ($($t:ty),*) => {
        $(
            impl Stateful for $t {
                fn state(&self) -> kiln_state::Result<StateDict> {
                    save(self)
                }
                fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
                    load(self, &state)
                }
            }
        )*
    };
}

stateful_scaler!(
    DynamicLossScaler,
    StaticLossScaler,
    NoScaler,
    dyn LossScaler
);

/// The boxed scaler a trainer holds.
impl Stateful for Box<dyn LossScaler> {
    fn state(&self) -> kiln_state::Result<StateDict> {
        save(&**self)
    }
    fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
        load(&mut **self, &state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DynamicScalerConfig;

    #[test]
    fn a_restored_scaler_continues_bitwise_and_refuses_another_kind() {
        let cfg = DynamicScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            hysteresis: 2,
            ..DynamicScalerConfig::default()
        };
        let mut a = DynamicLossScaler::new(cfg).unwrap();
        for found_inf in [false, true, false, false, true, true, false] {
            a.update(found_inf).unwrap();
        }
        let sd = Stateful::state(&a).unwrap();
        let mut b: Box<dyn LossScaler> = Box::new(DynamicLossScaler::default());
        b.load_state(sd.clone()).unwrap();
        for found_inf in [false, false, false, true, false, false, false, false] {
            let (ea, eb) = (a.update(found_inf).unwrap(), b.update(found_inf).unwrap());
            assert_eq!(ea, eb);
            assert_eq!(a.scale().to_bits(), b.scale().to_bits());
        }
        let e = NoScaler.load_state(sd).unwrap_err().to_string();
        assert!(e.starts_with("loss scaler:"), "{e}");
    }
}
