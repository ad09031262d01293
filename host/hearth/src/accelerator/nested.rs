//! Operations over nested structures of tensors — Accelerate's
//! `recursively_apply`, `send_to_device`, `convert_to_fp32`, `concatenate`,
//! `slice_tensors` and `listify` — as one trait that tensors, vectors,
//! options, tuples, string-keyed maps and token batches implement.

use crate::data::Batch;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use tch::{Device, Kind, Tensor};

/// A value made of tensors. Implement [`map_tensors`](Self::map_tensors),
/// [`tensors`](Self::tensors) and [`concatenate`](Self::concatenate) for a
/// new container; the rest follows.
pub trait TensorTree: Sized {
    /// The same structure with `f` applied to every tensor
    /// (`recursively_apply`).
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self;
    /// Every tensor, depth first.
    fn tensors(&self) -> Vec<&Tensor>;
    /// Joins values of the same structure, tensors along dimension 0.
    fn concatenate(parts: Vec<Self>) -> Self;
    /// The structure without its tensors (what Accelerate's
    /// `get_data_structure` sends ahead of a dispatched batch).
    fn shape(&self) -> TreeShape;
    /// A value of structure `shape` holding `tensors` in the order
    /// [`tensors`](Self::tensors) lists them; `None` when they do not fit.
    fn from_tensors(shape: &TreeShape, tensors: &mut dyn Iterator<Item = Tensor>) -> Option<Self>;

    /// Every tensor moved to `device` (`send_to_device`).
    fn to_device(&self, device: Device) -> Self {
        self.map_tensors(&mut |t| t.to_device(device))
    }
    /// Accelerate's `send_to_device(value, device, non_blocking,
    /// skip_keys)`: every tensor moved to `device` but those under a map
    /// key in `skip_keys` (at any depth), which stay as they are; with
    /// `non_blocking` a copy from pinned host memory to a GPU does not
    /// wait for the GPU.
    fn send_to_device(&self, device: Device, non_blocking: bool, skip_keys: &[&str]) -> Self {
        self.map_tensors_skipping(skip_keys, &mut |t| {
            t.to_device_(device, t.kind(), non_blocking, false)
        })
    }
    /// [`map_tensors`](Self::map_tensors), leaving the tensors under a map
    /// key in `skip_keys` (at any depth) as they are. Containers of other
    /// trees pass `skip_keys` down; string-keyed maps apply it.
    fn map_tensors_skipping(
        &self,
        skip_keys: &[&str],
        f: &mut dyn FnMut(&Tensor) -> Tensor,
    ) -> Self {
        let _ = skip_keys;
        self.map_tensors(f)
    }
    /// Half and bfloat16 tensors as float32, the rest unchanged
    /// (`convert_to_fp32`).
    fn to_fp32(&self) -> Self {
        self.map_tensors(&mut |t| match t.kind() {
            Kind::Half | Kind::BFloat16 => t.to_kind(Kind::Float),
            _ => t.shallow_clone(),
        })
    }
    /// Rows `start..end` of every tensor (`slice_tensors`).
    fn slice_rows(&self, start: i64, end: i64) -> Self {
        self.map_tensors(&mut |t| {
            if t.dim() == 0 {
                return t.shallow_clone();
            }
            let rows = t.size()[0];
            let lo = start.clamp(0, rows);
            t.narrow(0, lo, end.clamp(lo, rows) - lo)
        })
    }
    /// The values as JSON numbers in nested lists (`listify`).
    fn listify(&self) -> Vec<Value> {
        self.tensors().into_iter().map(tensor_to_json).collect()
    }
}

/// The structure of a [`TensorTree`] value without its tensors.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum TreeShape {
    /// One tensor.
    Tensor,
    /// A list, or a record of tensors, of these parts.
    List(Vec<TreeShape>),
    /// An absent optional value.
    Absent,
    /// A present optional value.
    Present(Box<TreeShape>),
    /// Named parts, in key order.
    Map(Vec<(String, TreeShape)>),
}

fn tensor_to_json(t: &Tensor) -> Value {
    let t = t.to_device(Device::Cpu).to_kind(Kind::Double);
    if t.dim() == 0 {
        return serde_json::json!(f64::try_from(&t).unwrap_or(f64::NAN));
    }
    Value::Array(
        (0..t.size()[0])
            .map(|i| tensor_to_json(&t.get(i)))
            .collect(),
    )
}

impl TensorTree for Tensor {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        f(self)
    }
    fn tensors(&self) -> Vec<&Tensor> {
        vec![self]
    }
    fn concatenate(parts: Vec<Self>) -> Self {
        Tensor::cat(&parts, 0)
    }
    fn shape(&self) -> TreeShape {
        TreeShape::Tensor
    }
    fn from_tensors(shape: &TreeShape, tensors: &mut dyn Iterator<Item = Tensor>) -> Option<Self> {
        (*shape == TreeShape::Tensor)
            .then(|| tensors.next())
            .flatten()
    }
}

impl<T: TensorTree> TensorTree for Vec<T> {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        self.iter().map(|x| x.map_tensors(f)).collect()
    }
    fn map_tensors_skipping(&self, skip: &[&str], f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        self.iter()
            .map(|x| x.map_tensors_skipping(skip, f))
            .collect()
    }
    fn tensors(&self) -> Vec<&Tensor> {
        self.iter().flat_map(TensorTree::tensors).collect()
    }
    fn concatenate(parts: Vec<Self>) -> Self {
        let width = parts.first().map_or(0, Vec::len);
        let mut columns: Vec<Vec<T>> = (0..width).map(|_| Vec::new()).collect();
        for part in parts {
            assert_eq!(part.len(), width, "concatenate: lists of different lengths");
            for (c, x) in columns.iter_mut().zip(part) {
                c.push(x);
            }
        }
        columns.into_iter().map(T::concatenate).collect()
    }
    fn shape(&self) -> TreeShape {
        TreeShape::List(self.iter().map(TensorTree::shape).collect())
    }
    fn from_tensors(shape: &TreeShape, tensors: &mut dyn Iterator<Item = Tensor>) -> Option<Self> {
        match shape {
            TreeShape::List(parts) => parts.iter().map(|p| T::from_tensors(p, tensors)).collect(),
            _ => None,
        }
    }
}

impl<T: TensorTree> TensorTree for Option<T> {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        self.as_ref().map(|x| x.map_tensors(f))
    }
    fn map_tensors_skipping(&self, skip: &[&str], f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        self.as_ref().map(|x| x.map_tensors_skipping(skip, f))
    }
    fn tensors(&self) -> Vec<&Tensor> {
        self.as_ref().map_or_else(Vec::new, TensorTree::tensors)
    }
    fn concatenate(parts: Vec<Self>) -> Self {
        let present: Option<Vec<T>> = parts.into_iter().collect();
        present.map(T::concatenate)
    }
    fn shape(&self) -> TreeShape {
        match self {
            Some(x) => TreeShape::Present(Box::new(x.shape())),
            None => TreeShape::Absent,
        }
    }
    fn from_tensors(shape: &TreeShape, tensors: &mut dyn Iterator<Item = Tensor>) -> Option<Self> {
        match shape {
            TreeShape::Absent => Some(None),
            TreeShape::Present(inner) => T::from_tensors(inner, tensors).map(Some),
            _ => None,
        }
    }
}

impl<A: TensorTree, B: TensorTree> TensorTree for (A, B) {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        (self.0.map_tensors(f), self.1.map_tensors(f))
    }
    fn map_tensors_skipping(&self, skip: &[&str], f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        (
            self.0.map_tensors_skipping(skip, f),
            self.1.map_tensors_skipping(skip, f),
        )
    }
    fn tensors(&self) -> Vec<&Tensor> {
        let mut all = self.0.tensors();
        all.extend(self.1.tensors());
        all
    }
    fn concatenate(parts: Vec<Self>) -> Self {
        let (a, b): (Vec<A>, Vec<B>) = parts.into_iter().unzip();
        (A::concatenate(a), B::concatenate(b))
    }
    fn shape(&self) -> TreeShape {
        TreeShape::List(vec![self.0.shape(), self.1.shape()])
    }
    fn from_tensors(shape: &TreeShape, tensors: &mut dyn Iterator<Item = Tensor>) -> Option<Self> {
        match shape {
            TreeShape::List(parts) if parts.len() == 2 => Some((
                A::from_tensors(&parts[0], tensors)?,
                B::from_tensors(&parts[1], tensors)?,
            )),
            _ => None,
        }
    }
}

macro_rules! string_map {
    ($map:ident) => {
        impl<T: TensorTree> TensorTree for $map<String, T> {
            fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
                self.iter()
                    .map(|(k, v)| (k.clone(), v.map_tensors(f)))
                    .collect()
            }
            fn map_tensors_skipping(
                &self,
                skip: &[&str],
                f: &mut dyn FnMut(&Tensor) -> Tensor,
            ) -> Self {
                let keep = &mut |t: &Tensor| t.shallow_clone();
                self.iter()
                    .map(|(k, v)| {
                        let v = if skip.contains(&k.as_str()) {
                            v.map_tensors(keep)
                        } else {
                            v.map_tensors_skipping(skip, f)
                        };
                        (k.clone(), v)
                    })
                    .collect()
            }
            fn tensors(&self) -> Vec<&Tensor> {
                let mut keys: Vec<&String> = self.keys().collect();
                keys.sort();
                keys.into_iter().flat_map(|k| self[k].tensors()).collect()
            }
            fn concatenate(parts: Vec<Self>) -> Self {
                let mut columns: $map<String, Vec<T>> = $map::new();
                for part in parts {
                    for (k, v) in part {
                        columns.entry(k).or_default().push(v);
                    }
                }
                columns
                    .into_iter()
                    .map(|(k, v)| (k, T::concatenate(v)))
                    .collect()
            }
            fn shape(&self) -> TreeShape {
                let mut keys: Vec<&String> = self.keys().collect();
                keys.sort();
                TreeShape::Map(
                    keys.into_iter()
                        .map(|k| (k.clone(), self[k].shape()))
                        .collect(),
                )
            }
            fn from_tensors(
                shape: &TreeShape,
                tensors: &mut dyn Iterator<Item = Tensor>,
            ) -> Option<Self> {
                match shape {
                    TreeShape::Map(parts) => parts
                        .iter()
                        .map(|(k, p)| Some((k.clone(), T::from_tensors(p, tensors)?)))
                        .collect(),
                    _ => None,
                }
            }
        }
    };
}
string_map!(BTreeMap);
string_map!(HashMap);

impl TensorTree for Batch {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self {
        Batch {
            inputs: f(&self.inputs),
            targets: f(&self.targets),
        }
    }
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.inputs, &self.targets]
    }
    fn concatenate(parts: Vec<Self>) -> Self {
        let (inputs, targets): (Vec<Tensor>, Vec<Tensor>) =
            parts.into_iter().map(|b| (b.inputs, b.targets)).unzip();
        Batch {
            inputs: Tensor::cat(&inputs, 0),
            targets: Tensor::cat(&targets, 0),
        }
    }
    fn shape(&self) -> TreeShape {
        TreeShape::List(vec![TreeShape::Tensor, TreeShape::Tensor])
    }
    fn from_tensors(shape: &TreeShape, tensors: &mut dyn Iterator<Item = Tensor>) -> Option<Self> {
        let (inputs, targets) = <(Tensor, Tensor)>::from_tensors(shape, tensors)?;
        Some(Batch { inputs, targets })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    /// Accelerate's `skip_keys`: a map key in it leaves its value alone at
    /// any depth, through lists, options and pairs; other keys' tensors
    /// are mapped.
    #[test]
    fn skip_keys_leave_their_values_alone_at_any_depth() {
        let mut inner = HashMap::new();
        inner.insert("labels".to_string(), t(&[1.0]));
        inner.insert("ids".to_string(), t(&[2.0]));
        let mut outer = BTreeMap::new();
        outer.insert(
            "labels".to_string(),
            vec![Some(inner.map_tensors(&mut |x| x.copy()))],
        );
        outer.insert("batch".to_string(), vec![Some(inner)]);
        let tree = (outer, t(&[3.0]));
        let mapped = tree.map_tensors_skipping(&["labels"], &mut |x| x + 10);
        let value = |m: &HashMap<String, Tensor>, k: &str| f64::try_from(&m[k]).unwrap();
        let batch = mapped.0["batch"][0].as_ref().unwrap();
        assert_eq!((value(batch, "ids"), value(batch, "labels")), (12.0, 1.0));
        let labels = mapped.0["labels"][0].as_ref().unwrap();
        assert_eq!((value(labels, "ids"), value(labels, "labels")), (2.0, 1.0));
        assert_eq!(f64::try_from(&mapped.1).unwrap(), 13.0);
        // send_to_device takes the same path; on the CPU it keeps the tensors.
        let sent = tree.send_to_device(Device::Cpu, true, &["labels"]);
        assert_eq!(sent.listify(), tree.listify());
    }

    #[test]
    fn maps_through_every_container() {
        let mut m = BTreeMap::new();
        m.insert("a".to_string(), vec![(t(&[1.0]), Some(t(&[2.0])))]);
        let doubled = m.map_tensors(&mut |x| x * 2);
        assert_eq!(
            doubled.listify(),
            vec![serde_json::json!([2.0]), serde_json::json!([4.0])]
        );
    }

    #[test]
    fn concatenates_matching_structures_and_slices_rows() {
        let parts = vec![
            (t(&[1.0, 2.0]), vec![t(&[3.0])]),
            (t(&[4.0]), vec![t(&[5.0, 6.0])]),
        ];
        let (a, b) = <(Tensor, Vec<Tensor>)>::concatenate(parts);
        assert_eq!(Vec::<f32>::try_from(&a).unwrap(), vec![1.0, 2.0, 4.0]);
        assert_eq!(Vec::<f32>::try_from(&b[0]).unwrap(), vec![3.0, 5.0, 6.0]);
        let sliced = (a, b).slice_rows(1, 10);
        assert_eq!(Vec::<f32>::try_from(&sliced.0).unwrap(), vec![2.0, 4.0]);
    }

    #[test]
    fn a_structure_is_rebuilt_from_its_shape_and_tensors() {
        let mut m = BTreeMap::new();
        m.insert("b".to_string(), (t(&[1.0]), None::<Tensor>));
        m.insert("a".to_string(), (t(&[2.0, 3.0]), Some(t(&[4.0]))));
        let value = vec![m];
        let shape = value.shape();
        let json = serde_json::to_string(&shape).unwrap();
        let shape: TreeShape = serde_json::from_str(&json).unwrap();
        let leaves: Vec<Tensor> = value.tensors().into_iter().map(|x| x * 10).collect();
        let rebuilt = Vec::<BTreeMap<String, (Tensor, Option<Tensor>)>>::from_tensors(
            &shape,
            &mut leaves.into_iter(),
        )
        .unwrap();
        assert_eq!(rebuilt.shape(), value.shape());
        assert_eq!(
            rebuilt.listify(),
            vec![
                serde_json::json!([20.0, 30.0]),
                serde_json::json!([40.0]),
                serde_json::json!([10.0])
            ]
        );
        assert!(Tensor::from_tensors(&TreeShape::Absent, &mut std::iter::empty()).is_none());
        assert!(Tensor::from_tensors(&TreeShape::Tensor, &mut std::iter::empty()).is_none());
    }

    #[test]
    fn converts_only_half_precision_to_fp32() {
        let x = vec![
            t(&[1.0]).to_kind(Kind::BFloat16),
            Tensor::from_slice(&[1i64]),
        ];
        let y = x.to_fp32();
        assert_eq!((y[0].kind(), y[1].kind()), (Kind::Float, Kind::Int64));
    }
}
