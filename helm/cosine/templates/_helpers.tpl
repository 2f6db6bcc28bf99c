{{/* Names, labels and the one workload template every role (router, scheduler, fusion, verifier, drafters) renders through. */}}

{{- define "cosine.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cosine.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cosine.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "cosine.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cosine.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "cosine.labels" -}}
helm.sh/chart: {{ include "cosine.chart" .root }}
{{ include "cosine.selectorLabels" . }}
app.kubernetes.io/part-of: cosine
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{- define "cosine.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cosine.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Deep overlay: src's keys win, maps merge key by key; unlike sprig's merge, a 0/false/"" in src still wins. Mutates dst. */}}
{{- define "cosine.overlay" -}}
{{- $dst := .dst -}}
{{- range $k, $v := .src -}}
{{- if and (kindIs "map" $v) (kindIs "map" (get $dst $k)) -}}
{{- include "cosine.overlay" (dict "dst" (get $dst $k) "src" $v) -}}
{{- else -}}
{{- $_ := set $dst $k $v -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A drafter entry with drafterDefaults under it, as JSON: (dict "root" $ "drafter" $d) */}}
{{- define "cosine.drafterConfig" -}}
{{- $cfg := deepCopy .root.Values.drafterDefaults -}}
{{- include "cosine.overlay" (dict "dst" $cfg "src" (deepCopy .drafter)) -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* gRPC target of an internal role: dns:/// over its headless Service, so the caller sees every ready pod (the scheduler
and fusion resolve it in cosine.common.pool and pick by load; the router's channel round-robins). (dict "root" $ "component" "verifier" "port" 50054) */}}
{{- define "cosine.address" -}}
{{- $r := .root -}}
{{- printf "dns:///%s-%s.%s.svc.%s:%d" (include "cosine.fullname" $r) .component $r.Release.Namespace $r.Values.clusterDomain (int .port) -}}
{{- end -}}

{{- define "cosine.drafterAddress" -}}
{{- include "cosine.address" (dict "root" .root "component" (printf "drafter-%s" .name) "port" .port) -}}
{{- end -}}

{{/* Custom resources render only where the cluster serves their API (helm template: pass --api-versions). */}}
{{- define "cosine.hasKeda" -}}
{{- if .Capabilities.APIVersions.Has "keda.sh/v1alpha1/ScaledObject" -}}true{{- end -}}
{{- end -}}

{{- define "cosine.hasServiceMonitor" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor" -}}true{{- end -}}
{{- end -}}

{{/* What the workload of a role renders for autoscaling, as JSON {"kind": "ScaledObject"|"HorizontalPodAutoscaler"|"", "skipped": bool}:
(dict "root" $ "cfg" $cfg) */}}
{{- define "cosine.autoscaler" -}}
{{- $cfg := .cfg -}}
{{- $kind := "" -}}
{{- $skipped := false -}}
{{- if $cfg.autoscaling.enabled -}}
{{- if and $cfg.autoscaling.metrics (eq .root.Values.autoscaling.metricsMode "keda") -}}
{{- if include "cosine.hasKeda" .root -}}{{- $kind = "ScaledObject" -}}{{- else -}}{{- $skipped = true -}}{{- end -}}
{{- else -}}
{{- $kind = "HorizontalPodAutoscaler" -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "kind" $kind "skipped" $skipped) -}}
{{- end -}}

{{/* The verifier's KV slots: verifier.maxSlots, or when 0 sized from verifier.kvCache (formula in values.yaml and the chart README). */}}
{{- define "cosine.verifierSlots" -}}
{{- $v := .Values.verifier -}}
{{- if gt (int $v.maxSlots) 0 -}}
{{- $v.maxSlots -}}
{{- else -}}
{{- $kv := $v.kvCache -}}
{{- $gpu := gt (int $v.gpu.count) 0 -}}
{{- $bytes := 2 -}}
{{- if or (eq $v.dtype "float32") (and (eq $v.dtype "auto") (not $gpu)) -}}{{- $bytes = 4 -}}{{- end -}}
{{- $perPosition := mul 2 (int $kv.model.layers) (int $kv.model.kvHeads) (int $kv.model.headDim) $bytes -}}
{{- $free := subf (float64 $kv.deviceMemoryGiB) (float64 $kv.reservedGiB) -}}
{{- $slots := int (floor (divf (mulf $free 1073741824.0) (mul $perPosition (int $kv.maxContext)))) -}}
{{- if lt $slots 1 -}}
{{- fail (printf "verifier.kvCache: %v GiB minus %v GiB reserved holds no KV slot of %d MiB (maxContext %d); raise deviceMemoryGiB, lower reservedGiB or maxContext, or set verifier.maxSlots" $kv.deviceMemoryGiB $kv.reservedGiB (div (mul $perPosition (int $kv.maxContext)) 1048576) (int $kv.maxContext)) -}}
{{- end -}}
{{- min $slots (int $kv.maxSlotsCap) -}}
{{- end -}}
{{- end -}}

{{/* The pods of a role the chart starts with: autoscaling.minReplicas when it autoscales (a skipped ScaledObject also
runs it at minReplicas), else replicas. (the role's values) */}}
{{- define "cosine.startPods" -}}
{{- ternary .autoscaling.minReplicas .replicas .autoscaling.enabled | int -}}
{{- end -}}

{{/* Admission of one router pod (COSINE_ROUTER_MAX_STREAMS): router.maxStreams, or when "auto"
floor(verifier KV slots x verifier pods / router pods), at least 1 (formula in values.yaml and the chart README). */}}
{{- define "cosine.routerMaxStreams" -}}
{{- $m := .Values.router.maxStreams -}}
{{- if or (kindIs "invalid" $m) (eq (toString $m) "auto") -}}
{{- $slots := include "cosine.verifierSlots" . | int -}}
{{- $verifiers := include "cosine.startPods" .Values.verifier | int -}}
{{- $routers := max 1 (include "cosine.startPods" .Values.router | int) -}}
{{- max 1 (div (mul $slots $verifiers) $routers) -}}
{{- else -}}
{{- int $m -}}
{{- end -}}
{{- end -}}

{{/* The image of a role: (dict "root" $ "cfg" $cfg) */}}
{{- define "cosine.image" -}}
{{- $img := deepCopy .root.Values.image -}}
{{- include "cosine.overlay" (dict "dst" $img "src" (default (dict) .cfg.image)) -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- if and (gt (int .cfg.gpu.count) 0) (not (.cfg.image | default (dict)).tag) -}}
{{- $tag = printf "%s%s" $tag $img.gpuTagSuffix -}}
{{- end -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "cosine.imagePullPolicy" -}}
{{- (.cfg.image | default (dict)).pullPolicy | default .root.Values.image.pullPolicy -}}
{{- end -}}

{{- define "cosine.redisUrlEnv" -}}
{{- $r := .Values.redis -}}
{{- if $r.existingSecret }}
- name: COSINE_SCHEDULER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.existingSecret }}
      key: redis-url
{{- else if $r.bundled }}
- name: COSINE_SCHEDULER_REDIS_URL
  value: {{ printf "redis://%s-redis:%d/0" (include "cosine.fullname" .) (int $r.port) | quote }}
{{- else }}
- name: COSINE_SCHEDULER_REDIS_URL
  value: {{ required "redis.externalUrl (or redis.existingSecret) is required when redis.bundled is false" $r.externalUrl | quote }}
{{- end }}
{{- end -}}

{{/*
One role: Deployment, Service, PDB, autoscaler and ServiceMonitor.
(dict "root" $ "component" "router" "prefix" "COSINE_ROUTER_" "service" "router" "cfg" $cfg "env" $envYaml "models" true "name" "drafter NAME or empty"
      "initContainers" "YAML list of init containers run first, or empty"
      "volumes" "YAML list of extra pod volumes" "mounts" "YAML list of their mounts in the service's container")
*/}}
{{- define "cosine.workload" -}}
{{- $root := .root -}}
{{- $cfg := .cfg -}}
{{- $component := .component -}}
{{- $fullname := printf "%s-%s" (include "cosine.fullname" $root) $component | trunc 63 | trimSuffix "-" -}}
{{- $ctx := dict "root" $root "component" $component -}}
{{- $gpu := gt (int $cfg.gpu.count) 0 -}}
{{- $drain := int $root.Values.drainTimeoutSeconds -}}
{{- $delay := int $root.Values.shutdownDelaySeconds -}}
{{- $storage := $root.Values.models.storage -}}
{{- $prepare := and .models $root.Values.models.prepare.enabled (ne $storage.type "image") -}}
{{- $scaler := include "cosine.autoscaler" (dict "root" $root "cfg" $cfg) | fromJson -}}
{{- $public := eq $component "router" -}}
{{- $hostPath := and .models (eq $storage.type "hostPath") -}}
{{- $tls := $root.Values.tls.enabled -}}
{{- $probePort := ternary $root.Values.tls.healthPort $cfg.port $tls -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cosine.labels" $ctx | nindent 4 }}
  annotations:
    checkov.io/skip1: CKV_K8S_43=The tag is the chart's appVersion by default; set image.digest to pin by digest (rendered as repository@digest).
    checkov.io/skip2: CKV_K8S_15=IfNotPresent is deliberate for multi-GB CUDA images on GPU nodes; tags are immutable release tags, set image.pullPolicy to Always to change it.
    {{- if $hostPath }}
    checkov.io/skip3: CKV_K8S_25=hostPath volumes ignore fsGroup, so the own-models init container adds CAP_CHOWN (all else dropped) only to chown the cache directory to the pods' uid, then exits.
    {{- end }}
spec:
  {{- if not $scaler.kind }}
  # {{ if $scaler.skipped }}no autoscaler (its API is not served here, see NOTES): minReplicas{{ else }}not autoscaled{{ end }}
  replicas: {{ ternary $cfg.autoscaling.minReplicas $cfg.replicas $scaler.skipped }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "cosine.selectorLabels" $ctx | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  template:
    metadata:
      labels:
        {{- include "cosine.labels" $ctx | nindent 8 }}
        {{- with $root.Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $root.Values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "cosine.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      # preStop sleep + drain + 5s for closing channels and freeing the model
      terminationGracePeriodSeconds: {{ add $delay $drain 5 }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- $nodeSelector := deepCopy (default (dict) $cfg.nodeSelector) -}}
      {{- if $gpu }}{{- $nodeSelector = merge $nodeSelector (default (dict) $cfg.gpu.nodeSelector) -}}{{- end }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $tolerations := default (list) $cfg.tolerations -}}
      {{- if $gpu }}{{- $tolerations = concat $tolerations (default (list) $cfg.gpu.tolerations) -}}{{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if or .initContainers $prepare $hostPath }}
      initContainers:
        {{- with .initContainers }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if $hostPath }}
        # fsGroup does not apply to hostPath volumes: hand the node's cache directory to the pods' user (top level only)
        - name: own-models
          image: {{ include "cosine.image" (dict "root" $root "cfg" $cfg) }}
          imagePullPolicy: {{ include "cosine.imagePullPolicy" (dict "root" $root "cfg" $cfg) }}
          command: ["chown", "{{ $root.Values.podSecurityContext.runAsUser }}:{{ $root.Values.podSecurityContext.fsGroup }}", "/var/cache/cosine"]
          securityContext:
            runAsUser: 0
            runAsGroup: 0
            runAsNonRoot: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            privileged: false
            capabilities:
              drop: ["ALL"]
              add: ["CHOWN"]
            seccompProfile:
              type: RuntimeDefault
          resources:
            requests: {cpu: 10m, memory: 16Mi}
            limits: {cpu: 100m, memory: 64Mi}
          volumeMounts:
            - {name: models, mountPath: /var/cache/cosine}
        {{- end }}
        {{- if $prepare }}
        # one preparer per volume: the others wait on the lock, then find the models' cards and return at once;
        # `cosine zoo prepare` writes each model to NAME.partial and renames it into place, its card (cosine.json) last
        - name: prepare-models
          image: {{ include "cosine.image" (dict "root" $root "cfg" $cfg) }}
          imagePullPolicy: {{ include "cosine.imagePullPolicy" (dict "root" $root "cfg" $cfg) }}
          command:
            - python
            - -c
            - |
              import fcntl, os, subprocess, sys
              lock = open(os.path.join(os.environ["COSINE_CACHE"], ".prepare.lock"), "a")
              print("waiting for the model volume's lock", flush=True)
              fcntl.flock(lock, fcntl.LOCK_EX)
              sys.exit(subprocess.call(["cosine", "zoo", "prepare"]))
          env:
            - {name: COSINE_CACHE, value: /var/cache/cosine}
            - {name: HOME, value: /tmp}
            - {name: HF_HOME, value: /tmp/huggingface}
            - {name: PIP_CACHE_DIR, value: /tmp/pip}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml $root.Values.models.prepare.resources | nindent 12 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            - {name: models, mountPath: /var/cache/cosine}
        {{- end }}
      {{- end }}
      containers:
        - name: {{ .service }}
          image: {{ include "cosine.image" (dict "root" $root "cfg" $cfg) }}
          imagePullPolicy: {{ include "cosine.imagePullPolicy" (dict "root" $root "cfg" $cfg) }}
          args:
            - serve
            - {{ .service }}
            {{- range $cfg.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - {name: grpc, containerPort: {{ $cfg.port }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $cfg.metricsPort }}, protocol: TCP}
            {{- if $tls }}
            - {name: health, containerPort: {{ $root.Values.tls.healthPort }}, protocol: TCP}
            {{- end }}
          env:
            - {name: {{ .prefix }}HOST, value: "0.0.0.0"}
            - {name: {{ .prefix }}PORT, value: {{ $cfg.port | quote }}}
            - {name: {{ .prefix }}METRICS_PORT, value: {{ $cfg.metricsPort | quote }}}
            - {name: {{ .prefix }}DRAIN_TIMEOUT_S, value: {{ $drain | quote }}}
            # the preStop sleep already covers endpoint removal: drain at once on SIGTERM
            - {name: {{ .prefix }}SHUTDOWN_DELAY_S, value: "0"}
            - {name: {{ .prefix }}LOG_LEVEL, value: {{ $root.Values.logLevel | quote }}}
            - {name: {{ .prefix }}MAX_CONNECTION_AGE_S, value: {{ $root.Values.maxConnectionAgeSeconds | quote }}}
            {{- if $tls }}
            # TLS on the port, mTLS on the channels to other roles{{ if not $public }}, client certificates required{{ end }}; probes use the plaintext health port
            - {name: {{ .prefix }}TLS_CERT_FILE, value: /etc/cosine/tls/tls.crt}
            - {name: {{ .prefix }}TLS_KEY_FILE, value: /etc/cosine/tls/tls.key}
            - {name: {{ .prefix }}TLS_CA_FILE, value: /etc/cosine/tls/ca.crt}
            {{- if not $public }}
            - {name: {{ .prefix }}TLS_CLIENT_CA_FILE, value: /etc/cosine/tls/ca.crt}
            {{- end }}
            - {name: {{ .prefix }}HEALTH_PORT, value: {{ $root.Values.tls.healthPort | quote }}}
            {{- end }}
            - {name: COSINE_CACHE, value: {{ ternary "/opt/cosine/cache" "/var/cache/cosine" (eq $storage.type "image") }}}
            - {name: HOME, value: /tmp}
            - {name: HF_HOME, value: /tmp/huggingface}
            - {name: PYTHONUNBUFFERED, value: "1"}
            - {name: TOKENIZERS_PARALLELISM, value: "false"}
            {{- .env | nindent 12 }}
            {{- with $cfg.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $res := deepCopy (default (dict) $cfg.resources) }}
          {{- if $gpu }}
          {{- $limits := default (dict) $res.limits }}
          {{- $_ := set $limits $cfg.gpu.resourceName (int $cfg.gpu.count) }}
          {{- $_ := set $res "limits" $limits }}
          {{- $requests := default (dict) $res.requests }}
          {{- $_ := set $requests $cfg.gpu.resourceName (int $cfg.gpu.count) }}
          {{- $_ := set $res "requests" $requests }}
          {{- end }}
          resources:
            {{- toYaml $res | nindent 12 }}
          startupProbe:
            grpc: {port: {{ $probePort }}, service: liveness}
            {{- toYaml $cfg.probes.startup | nindent 12 }}
          livenessProbe:
            grpc: {port: {{ $probePort }}, service: liveness}
            {{- toYaml $cfg.probes.liveness | nindent 12 }}
          readinessProbe:
            grpc: {port: {{ $probePort }}, service: readiness}
            {{- toYaml $cfg.probes.readiness | nindent 12 }}
          lifecycle:
            preStop:
              # keep serving while the endpoint is removed everywhere; SIGTERM then drains (DRAIN_TIMEOUT_S)
              exec:
                command: ["sleep", {{ $delay | quote }}]
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            {{- if ne $storage.type "image" }}
            - {name: models, mountPath: /var/cache/cosine}
            {{- end }}
            {{- with .mounts }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $tls }}
            - {name: tls, mountPath: /etc/cosine/tls, readOnly: true}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: 2Gi
        {{- with .volumes }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if $tls }}
        - name: tls
          secret:
            secretName: {{ required "tls.secretName is required when tls.enabled (a kubernetes.io/tls Secret with ca.crt, see k8s/cert-manager.yaml)" $root.Values.tls.secretName }}
            defaultMode: 288
            items:
              - {key: tls.crt, path: tls.crt}
              - {key: tls.key, path: tls.key}
              - {key: ca.crt, path: ca.crt}
        {{- end }}
        {{- if ne $storage.type "image" }}
        - name: models
          {{- if and .models (eq $storage.type "pvc") }}
          persistentVolumeClaim:
            claimName: {{ default (printf "%s-models" (include "cosine.fullname" $root)) $storage.pvc.existingClaim }}
          {{- else if and .models (eq $storage.type "hostPath") }}
          hostPath:
            path: {{ $storage.hostPath.path }}
            type: DirectoryOrCreate
          {{- else }}
          emptyDir:
            sizeLimit: {{ ternary $storage.sizeLimit "256Mi" .models }}
          {{- end }}
        {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cosine.labels" $ctx | nindent 4 }}
  {{- with (($cfg.service | default (dict)).annotations) }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if $public }}
  type: {{ ($cfg.service | default (dict)).type | default "ClusterIP" }}
  {{- else }}
  # headless: DNS answers with every ready pod, the callers' channels spread requests over them
  clusterIP: None
  {{- end }}
  selector:
    {{- include "cosine.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $cfg.port }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
    - {name: metrics, port: {{ $cfg.metricsPort }}, targetPort: metrics, protocol: TCP, appProtocol: http}
{{- if $cfg.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cosine.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $cfg.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "cosine.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- $metrics := default (list) $cfg.autoscaling.metrics }}
{{- $drafter := .name | default "" }}
{{- $targets := list }}
{{- range $metrics }}
{{- if .targetSlotFraction }}
{{- $slots := required "autoscaling.metrics[].targetSlotFraction needs the role's `slots`" $cfg.slots }}
{{- $targets = append $targets (max 1 (int (floor (mulf (float64 $slots) .targetSlotFraction)))) }}
{{- else }}
{{- $targets = append $targets (required "autoscaling.metrics[] needs target or targetSlotFraction" .target) }}
{{- end }}
{{- end }}
{{- if eq $scaler.kind "ScaledObject" }}
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cosine.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    name: {{ $fullname }}
  minReplicaCount: {{ $cfg.autoscaling.minReplicas }}
  maxReplicaCount: {{ $cfg.autoscaling.maxReplicas }}
  pollingInterval: 15
  cooldownPeriod: 300
  triggers:
    {{- range $i, $m := $metrics }}
    - type: prometheus
      name: {{ $m.name }}
      metricType: AverageValue
      metadata:
        serverAddress: {{ $root.Values.autoscaling.prometheusAddress }}
        query: {{ $m.query | replace "DRAFTER" $drafter | replace "NAMESPACE" $root.Release.Namespace | quote }}
        threshold: {{ index $targets $i | toString | quote }}
    {{- end }}
{{- else if eq $scaler.kind "HorizontalPodAutoscaler" }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cosine.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $fullname }}
  minReplicas: {{ $cfg.autoscaling.minReplicas }}
  maxReplicas: {{ $cfg.autoscaling.maxReplicas }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: 300
  metrics:
    {{- if $metrics }}
    {{- range $i, $m := $metrics }}
    - type: External
      external:
        metric:
          name: {{ $m.external.name }}
          {{- with $m.external.matchLabels }}
          selector:
            matchLabels:
              {{- range $k, $v := . }}
              {{ $k }}: {{ replace "DRAFTER" $drafter $v | quote }}
              {{- end }}
          {{- end }}
        target:
          type: AverageValue
          averageValue: {{ index $targets $i | toString | quote }}
    {{- end }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $cfg.autoscaling.targetCPUUtilizationPercentage }}
    {{- end }}
{{- end }}
{{- if and $cfg.monitoring.serviceMonitor (include "cosine.hasServiceMonitor" $root) }}
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cosine.labels" $ctx | nindent 4 }}
    {{- with $root.Values.monitoring.serviceMonitorLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "cosine.selectorLabels" $ctx | nindent 6 }}
  namespaceSelector:
    matchNames: [{{ $root.Release.Namespace }}]
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $cfg.monitoring.interval }}
      # the services label their series service="..." themselves: keep it (autoscaling queries select on it)
      honorLabels: true
{{- end }}
{{- end -}}

{{/* grpcurl's transport flags for the router: plaintext, or TLS verified with the release's CA under the router's Service name */}}
{{- define "cosine.grpcurlTransport" -}}
{{- if .Values.tls.enabled -}}
-cacert ca.crt -servername {{ include "cosine.fullname" . }}-router.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}
{{- else -}}
-plaintext
{{- end -}}
{{- end -}}
