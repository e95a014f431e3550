// Validate CRD objects against their published schemas (the @kubernetes-models classes' validate()).
// Usage: node validate.js [NODE_MODULES] < objects.json   (a JSON list of objects)
// NODE_MODULES defaults to the repository's .cache/crd-schemas/node_modules (make setup-crd-schemas).
// Prints one line per invalid object, "Kind/name: error"; exits 0 when all are valid, 1 when any is invalid,
// 2 when a kind is unknown here, 3 when the packages are not installed.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

// apiVersion + kind -> the package module holding its class (imported by file: the packages live outside this
// folder, where node's resolution from here would not find them).
const MODELS = {
  "monitoring.coreos.com/v1 PodMonitor": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor.js",
  "gateway.networking.k8s.io/v1 HTTPRoute": "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute.js",
  "keda.sh/v1alpha1 ScaledObject": "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js",
};

const modules = process.argv[2] ?? fileURLToPath(new URL("../../../.cache/crd-schemas/node_modules", import.meta.url));
const objects = JSON.parse(readFileSync(0, "utf8"));
let status = 0;
for (const obj of objects) {
  const label = `${obj.kind}/${obj.metadata?.name}`;
  const path = MODELS[`${obj.apiVersion} ${obj.kind}`];
  if (path === undefined) {
    console.log(`${label}: no schema for apiVersion ${obj.apiVersion} kind ${obj.kind} here`);
    status = 2;
    continue;
  }
  let model;
  try {
    model = (await import(pathToFileURL(join(modules, path)).href))[obj.kind];
  } catch (err) {
    console.log(`${label}: cannot load ${path} from ${modules} (run make setup-crd-schemas): ${err.message}`);
    process.exit(3);
  }
  try {
    new model(obj).validate();
  } catch (err) {
    console.log(`${label}: ${err.message}`);
    status = Math.max(status, 1);
  }
}
process.exit(status);
